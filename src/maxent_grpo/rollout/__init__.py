"""Generation backends and the rollout record."""
