from seamlessflow.service import main
from sf_tag_scheduler.service import TagScheduler

main(TagScheduler())
