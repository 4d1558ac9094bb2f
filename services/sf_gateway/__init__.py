"""rollout-gateway service: the OpenAI-compatible data plane and its engine workers."""
