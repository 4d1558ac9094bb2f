"""The agent runner: a process that claims task samples from the trajectory service and
runs the run's agent (``seamlessflow.agents``: a registered name or a dotted path) for
each, in its own gateway session. The agents themselves, and the API they are written
against, live in the library; this package is only the process that drives them."""
