"""Built-in verifiable tasks with generated data (the embedded default: short arithmetic)."""
