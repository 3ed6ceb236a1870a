"""Topology.detect reads the rank each launcher sets (real variable names of each launcher)."""

from rlslurm.dist import Topology


def test_torchrun_names_win():
    t = Topology.detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_PROCID": "0"})
    assert (t.rank, t.world_size, t.local_rank) == (3, 4, 1)


def test_submitit_local_executor_names():
    # The variables submitit 1.5.4's local executor sets on each task it starts.
    env = {"SUBMITIT_LOCAL_GLOBALID": "2", "SUBMITIT_LOCAL_NTASKS": "3", "SUBMITIT_LOCAL_LOCALID": "2",
           "SUBMITIT_LOCAL_JOB_ID": "12345"}
    t = Topology.detect(env)
    assert (t.rank, t.world_size, t.local_rank) == (2, 3, 2)
    assert t.master_addr == "127.0.0.1"


def test_slurm_names_and_first_node_is_master():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "localhost"}
    t = Topology.detect(env)
    assert (t.rank, t.world_size, t.local_rank) == (5, 8, 1)
    assert t.master_addr == "localhost"  # a resolvable name is used as it is
    assert 15000 <= t.master_port < 45000


def test_nothing_set_is_a_single_process():
    t = Topology.detect({})
    assert (t.rank, t.world_size, t.local_rank) == (0, 1, 0)
