"""rlslurm: a SLURM-native job suite that takes an LLM from SFT to RL.

Start with the README; `rlslurm --help` lists the commands.
"""

from rlslurm import lifetime

__version__ = "0.1.0"

lifetime.leave_parent_cap()  # first thing: a process a memory-capped rank started is not the rank's memory
