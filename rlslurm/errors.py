"""The one small exception hierarchy of rlslurm.

The CLI (`rlslurm/cli/main.py`) turns each class into one message and its `exit_code`; a traceback
is printed only with `--debug`. Messages carry the evidence (key, job id, state, log path, ...).
"""

from __future__ import annotations


class RlslurmError(Exception):
    """Anything rlslurm reports to a user on purpose."""

    exit_code = 1


class ConfigError(RlslurmError):
    """A job YAML that cannot be loaded: bad syntax, unknown key, wrong type or value."""

    exit_code = 2


class PreflightError(RlslurmError):
    """The plan says the job cannot run as configured (OOM, broken divisibility, env mismatch)."""

    exit_code = 3


class SlurmCommandError(RlslurmError):
    """A SLURM command (sbatch, squeue, sacct, scontrol, scancel) failed; carries its stderr."""

    exit_code = 4


class SlurmParseError(RlslurmError):
    """SLURM printed something our parsers do not understand."""

    exit_code = 4


class CheckpointError(RlslurmError):
    """A checkpoint could not be written, or none complete exists where one is required."""

    exit_code = 5


class SyncVerifyError(RlslurmError):
    """A weight sync failed its checksum verification: the engine must not serve from it."""

    exit_code = 6


class StalenessError(RlslurmError):
    """A sample reached the loss more policy versions behind the trainer than rl.max_staleness allows."""

    exit_code = 1


class RewardServiceError(RlslurmError):
    """The reward service is unreachable or failed past the configured degradation policy."""

    exit_code = 8


class ResponsesError(RlslurmError):
    """A --responses file of `rlslurm score` that cannot be read: named by file and line."""

    exit_code = 2


class OutputFileError(RlslurmError):
    """A file the CLI was told to write is already there (or is a link it will not write through)."""

    exit_code = 2


class RunDirError(RlslurmError):
    """A run directory or job id that cannot be found or read."""

    exit_code = 9


class JobFailedError(RlslurmError):
    """A job `rlslurm submit --wait` waited for ended in failure, or without finishing (drained, hung)."""

    exit_code = 10
