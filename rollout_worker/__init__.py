"""rollout_worker package."""
