"""``python -m sf_tag_scheduler``: the tag-scheduler (``seamlessflow serve tag-scheduler``)."""

from seamlessflow.service import run_service_process
from sf_tag_scheduler.service import TagSchedulerService

run_service_process("tag-scheduler", TagSchedulerService)
