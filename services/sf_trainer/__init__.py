"""trainer service: GRPO-family policy optimisation on batches from the trajectory service."""
