"""Real pretrained models turned into the HF checkpoint directories that train.init_from reads (smollm2.py)."""
