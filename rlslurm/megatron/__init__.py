"""Megatron-core backend: the GPTModel built from `model:` (model.py) and its weight conversion to and
from the Hugging Face checkpoint layout (convert.py). Importing this package does not import megatron."""
