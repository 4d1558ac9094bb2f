"""The seamlessflow application: the CLI, the embedded local run and the simulator.

Above the services and the library (``sf_app -> sf_* services -> seamlessflow``): it
starts services by their table entry (``sf_app.service_table``), reads their
messages and files, and nothing below imports it.
"""
