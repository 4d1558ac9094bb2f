"""Locally built assets: the tiny tokenizer and base model (no model hub is reachable)."""
