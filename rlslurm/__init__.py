"""rlslurm: a SLURM-native job suite that takes an LLM from SFT to RL.

Start with the README; `rlslurm --help` lists the commands.
"""

__version__ = "0.1.0"
