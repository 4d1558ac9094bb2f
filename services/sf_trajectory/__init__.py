"""trajectory service: sessions, samples, GRPO groups, batches and the rollout rhythm."""
