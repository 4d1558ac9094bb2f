"""The embedded local run (``seamlessflow up``): configuration, supervision, report."""
