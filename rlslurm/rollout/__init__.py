"""Rollout engines (transformers on CPU, vLLM on GPU) and the HTTP server around them."""
