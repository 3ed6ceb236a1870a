"""Job entrances (SFT, RL roles) that run inside SLURM or local tasks."""
