"""The pure part of rlslurm/slurm/rejoin.py: when a het job's components are split. The states are those
`scontrol show job -o` gave on the local Slurm (tests/cluster/test_node_network.py makes them for real)."""

from __future__ import annotations

import pytest

from rlslurm.slurm.rejoin import batch_killed, split


def _job(*states: str) -> list[dict[str, str]]:
    return [{"JobId": str(12 + i), "HetJobOffset": str(i), "JobState": s} for i, s in enumerate(states)]


@pytest.mark.parametrize("states, is_split", [
    (("PENDING", "FAILED"), True),            # the train node lost: component 0 requeued, component 1 ended
    (("FAILED", "PENDING"), True),
    (("PENDING", "COMPLETED", "RUNNING"), True),
    (("PENDING", "PENDING"), False),           # SLURM requeued them all (a rollout node lost)
    (("COMPLETED", "COMPLETED"), False),       # the normal end: the triggers fire and do nothing
    (("CANCELLED", "CANCELLED"), False),       # the user's scancel
    (("PENDING", "CANCELLED"), False),         # a component the user cancelled is left cancelled
    (("RUNNING", "RUNNING"), False),
])
def test_a_job_is_split_when_one_component_pends_and_slurm_ended_another(states, is_split):
    assert split(_job(*states)) is is_split


def _ended(*states: tuple[str, str]) -> list[dict[str, str]]:
    return [{"JobId": str(12 + i), "HetJobOffset": str(i), "JobState": s, "ExitCode": c}
            for i, (s, c) in enumerate(states)]


@pytest.mark.parametrize("states, killed", [
    ((("FAILED", "0:9"), ("FAILED", "0:0")), True),     # kill -9 of the batch script's supervisor (issue 28)
    ((("FAILED", "0:15"), ("FAILED", "0:0")), True),
    ((("FAILED", "1:0"), ("COMPLETED", "0:0")), False),  # a rank's exception: the supervisor exited 1
    ((("COMPLETED", "0:0"), ("COMPLETED", "0:0")), False),
    ((("CANCELLED", "0:15"), ("CANCELLED", "0:15")), False),  # the user's scancel
    ((("TIMEOUT", "0:15"), ("FAILED", "0:0")), False),        # SLURM's time limit: its own stop
    ((("FAILED", "0:9"), ("PENDING", "0:0")), False),          # split: the rejoin above handles it
])
def test_a_batch_script_killed_by_a_signal_is_told_from_slurms_own_ends(states, killed):
    assert (batch_killed(_ended(*states)) is not None) is killed
