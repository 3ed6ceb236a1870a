"""The RL (GRPO) algorithm pieces: advantages, loss, experience."""
