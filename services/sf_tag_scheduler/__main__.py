"""``python -m sf_tag_scheduler``: the tag-scheduler (``seamlessflow serve tag-scheduler``)."""

from seamlessflow.service_table import run_process

run_process("tag-scheduler")
