"""Parsers of SLURM output against tables of real outputs.

Files in tests/unit/slurm_outputs/ were captured from the local Slurm 22.05 cluster
(rlslurm.slurm.localcluster) running a 2-component het job; inline strings marked "docs" are the
examples of SLURM's own man pages (hostlist expressions in `man sbatch` / `scontrol show hostnames`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.errors import SlurmParseError
from rlslurm.slurm import parse
from rlslurm.slurm.hetjob import component_job_id, components_from_env, context

OUT = Path(__file__).parent / "slurm_outputs"


@pytest.mark.parametrize("text, hosts", [
    ("n[1-3,5],m7", ["n1", "n2", "n3", "n5", "m7"]),
    ("n[1-2]", ["n1", "n2"]),                                   # real: squeue NODELIST of 3+0
    ("n3", ["n3"]),
    ("linux[0-3]", ["linux0", "linux1", "linux2", "linux3"]),    # docs: `scontrol show hostnames`
    ("lx[10-20]", [f"lx{i}" for i in range(10, 21)]),           # docs: sbatch --nodelist
    ("tux[2,1-2]", ["tux2", "tux1", "tux2"]),                   # docs: duplicates are kept in order
    ("node[01-03]", ["node01", "node02", "node03"]),            # zero padding kept
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("rack[1-2]-gpu[1-2]", ["rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"]),
    ("a1,b[2-3],c", ["a1", "b2", "b3", "c"]),
    ("(null)", []),                                             # real: a pending job's NodeList
    ("", []),
])
def test_expand_nodelist(text, hosts):
    assert parse.expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n[[1]]", "n[1,,2]", "n1,,n2", "n 1"])
def test_expand_nodelist_rejects_malformed(text):
    with pytest.raises(SlurmParseError, match="node list"):
        parse.expand_nodelist(text)


def test_scontrol_show_het_job_multiline():
    records = parse.scontrol_show((OUT / "scontrol_show_job_het.txt").read_text())
    assert [r["JobId"] for r in records] == ["3", "4"]
    assert [r["HetJobOffset"] for r in records] == ["0", "1"]
    assert all(r["HetJobId"] == "3" and r["HetJobIdSet"] == "3-4" for r in records)
    assert [r["Partition"] for r in records] == ["train", "rollout"]
    assert [r["NodeList"] for r in records] == ["n[1-2]", "n3"]
    assert records[0]["JobName"] == "het sleep"                 # a value with a space
    assert records[1]["StdOut"] == "/tmp/rlsB/exp/a b/out-4.txt"  # a path with a space
    assert records[1]["TRES"] == "cpu=2,node=1,billing=2"       # '=' inside a value
    assert records[1]["NtasksPerN:B:S:C"] == "2:0:*:*"
    assert records[0]["JobState"] == "RUNNING" and records[0]["Restarts"] == "0"


def test_scontrol_show_oneliner_matches_multiline():
    one = parse.scontrol_show((OUT / "scontrol_show_job_het_oneliner.txt").read_text())
    multi = parse.scontrol_show((OUT / "scontrol_show_job_het.txt").read_text())
    assert one == multi


@pytest.mark.parametrize("text", ["", "No jobs in the system\n"])
def test_scontrol_show_empty(text):
    assert parse.scontrol_show(text) == []


def test_scontrol_show_rejects_garbage():
    with pytest.raises(SlurmParseError, match="Key=value"):
        parse.scontrol_show("slurm_load_jobs error: Invalid job id specified")


def test_parsable2_sacct_c():
    rows = parse.parsable2((OUT / "sacct_c_parsable2.txt").read_text())
    assert len(rows) == 6
    assert rows[0] == {"JobID": "1", "JobName": "het.sh", "Partition": "train", "State": "COMPLETED",
                       "ExitCode": "0:0", "NodeList": "n1", "Start": "2026-12-01T00:12:41",
                       "End": "2026-12-01T00:12:41"}
    # Real flaw of `sacct -c`: a job name with a space ("het sleep") shifts its fields; State comes out empty.
    assert rows[2]["JobName"] == "het" and rows[2]["State"] == ""


def test_parsable2_docs_example():
    # docs: `sacct --parsable2` prints no trailing '|'; job steps as ID.batch / ID.0
    text = "JobID|JobName|State\n1234|x|COMPLETED\n1234.batch|batch|COMPLETED\n1234.0|hostname|COMPLETED\n"
    assert [r["JobID"] for r in parse.parsable2(text)] == ["1234", "1234.batch", "1234.0"]


@pytest.mark.parametrize("text", ["JobID|State\n1|RUNNING|extra\n", "JobID||State\n1|a|b\n"])
def test_parsable2_rejects_ragged(text):
    with pytest.raises(SlurmParseError, match="parsable2"):
        parse.parsable2(text)


def test_jobcomp_lines():
    lines = (OUT / "jobcomp_filetxt.txt").read_text().splitlines()
    records = [parse.jobcomp_line(ln) for ln in lines]
    assert [r["JobId"] for r in records] == ["1", "2", "3", "4", "5", "6"]
    assert records[2]["Name"] == "het sleep" and records[2]["JobState"] == "COMPLETED"
    assert [r["HetJobOffset"] for r in records[:2]] == ["0", "1"]
    assert records[0]["ReservationName"] == "" and records[0]["Tres"] == "cpu=2,mem=2000M,node=1,billing=2"
    with pytest.raises(SlurmParseError, match="JobState"):
        parse.jobcomp_line("UserId=root(0) Name=x")



def test_job_state_of_every_report_of_a_failed_het_job():
    # real: the three reports `rlslurm diag` keeps of a het job whose batch script exited 3
    shown = parse.scontrol_show((OUT / "scontrol_show_job_het_failed.txt").read_text())
    assert [r["JobState"] for r in shown] == ["FAILED", "FAILED"] and shown[0]["ExitCode"] == "3:0"
    assert parse.job_state(shown) == "FAILED"
    rows = parse.parsable2((OUT / "sacct_c_report_failed.txt").read_text())
    assert parse.job_state(rows) == "FAILED" and rows[0]["Elapsed"] == "00:00:00"
    assert parse.job_state([parse.jobcomp_line(ln) for ln in (OUT / "jobcomp_filetxt.txt").read_text().splitlines()]) \
        == "COMPLETED"


@pytest.mark.parametrize("records, state", [
    ([{"JobID": "12", "State": "CANCELLED by 0"}], "CANCELLED"),  # docs: sacct names who cancelled
    ([{"JobId": "7", "JobState": "TIMEOUT"}], "TIMEOUT"),
    ([], None),                                                  # scontrol: no jobs in the system
    ([{"JobID": "3", "State": ""}], None),                       # real: sacct -c's shifted row (sacct_c_parsable2.txt)
])
def test_job_state(records, state):
    assert parse.job_state(records) == state


def test_accounting_disabled_is_read_from_sacct_stderr():
    assert parse.accounting_disabled((OUT / "sacct_accounting_disabled.stderr.txt").read_text())  # real
    assert not parse.accounting_disabled("sacct: error: Invalid job id specified")


def test_sinfo_node_states():
    # real: every node listed once per partition it is in (urgent holds all five)
    states = parse.sinfo_node_states((OUT / "sinfo_node_states.txt").read_text())
    assert states == {"n1": "alloc", "n2": "alloc", "n3": "alloc", "n4": "idle", "n5": "idle"}
    # docs (man sinfo, NODE STATE CODES): a flag suffix is not part of the state
    assert parse.sinfo_node_states("n1|down*\nn2|idle~\nn3|mix#\n") == {"n1": "down", "n2": "idle", "n3": "mix"}
    with pytest.raises(SlurmParseError, match="NODE|STATE"):
        parse.sinfo_node_states("n1 idle\n")

SQUEUE_FIELDS = ("JobID", "State", "Partition", "Name", "NodeList", "NumTasks", "RestartCnt", "Reason")


def test_squeue_format_real():
    # real: squeue --noheader --Format=JobID:|,State:|,... for het job 3 (3+1 is job 4)
    text = "4|RUNNING|rollout|het sleep|n3|2|0|None|\n3|RUNNING|train|het sleep|n[1-2]|2|0|None|\n"
    rows = parse.squeue_format(text, SQUEUE_FIELDS)
    assert rows[1] == {"JobID": "3", "State": "RUNNING", "Partition": "train", "Name": "het sleep",
                       "NodeList": "n[1-2]", "NumTasks": "2", "RestartCnt": "0", "Reason": "None"}


@pytest.mark.parametrize("text", ["4|RUNNING|rollout\n", "4|RUNNING|rollout|het|n3|2|0|None|x\n"])
def test_squeue_format_rejects_wrong_shape(text):
    with pytest.raises(SlurmParseError, match="squeue row"):
        parse.squeue_format(text, SQUEUE_FIELDS)


@pytest.mark.parametrize("text, job_id, cluster", [
    ("5\n", "5", None),                                           # real: sbatch --parsable (het leader)
    ("1234;cluster1\n", "1234", "cluster1"),                      # docs: --parsable on a multi-cluster
    ("Submitted batch job 77\n", "77", None),
    ("sbatch: warning: something\n12\n", "12", None),
])
def test_sbatch_parsable(text, job_id, cluster):
    assert parse.sbatch_parsable(text) == parse.SbatchId(job_id, cluster)


@pytest.mark.parametrize("text", ["", "sbatch: error: Batch job submission failed: Invalid partition name specified\n"])
def test_sbatch_parsable_rejects(text):
    with pytest.raises(SlurmParseError):
        parse.sbatch_parsable(text)


@pytest.mark.parametrize("text, out", [("7", ("7", None)), ("7+1", ("7", 1)), (" 12+0 ", ("12", 0))])
def test_split_job_id(text, out):
    assert parse.split_job_id(text) == out


@pytest.mark.parametrize("text", ["7_3", "x", "7+"])
def test_split_job_id_rejects(text):
    with pytest.raises(SlurmParseError):
        parse.split_job_id(text)


def _real_batch_env() -> dict[str, str]:
    lines = (OUT / "het_batch_env.txt").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines)


def test_components_from_real_batch_env():
    comps = components_from_env(_real_batch_env())
    assert [(c.group, c.job_id, c.partition, c.nodes, c.ntasks) for c in comps] == [
        (0, "1", "train", ("n1",), 2), (1, "2", "rollout", ("n3",), 1)]


def test_context_in_component_1_step():
    env = {**_real_batch_env(), "RLSLURM_HET_GROUP": "1", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
           "SLURMD_NODENAME": "n3", "SLURM_RESTART_COUNT": "2"}
    ctx = context(env)
    assert (ctx.leader_job_id, ctx.group, ctx.rank, ctx.world, ctx.node, ctx.restart_count) == ("1", 1, 0, 1, "n3", 2)


def test_component_job_id_is_the_components_own_not_the_inherited_leaders():
    # real: a step of component 1 started from component 0 sees SLURM_JOB_ID = the leader's (1), its own is 2
    env = _real_batch_env()
    assert component_job_id({**env, "RLSLURM_HET_GROUP": "1"}) == "2"
    assert component_job_id(env) == "1"
    assert component_job_id({"SLURM_JOB_ID": "7"}) == "7" and component_job_id({}) is None


def test_context_outside_het_job_is_an_error():
    from rlslurm.errors import RlslurmError
    with pytest.raises(RlslurmError, match="SLURM_HET_SIZE"):
        context({"SLURM_JOB_ID": "3"})
