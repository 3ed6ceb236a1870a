"""Collective attribution (diag/collectives.py): torch's flight-recorder answer parsed, and the ranks compared.

The comparisons run on records as the node agent writes them; the last test replays the records of a real
desync (tests/data/diag/desync/, made by tests/integration/failures.py) and the unit tests below it use
tables shaped like them. The parser reads an answer of torch 2.13's `fr_trace_json` captured from two gloo
ranks here (rank 1 had skipped an all_reduce and entered a broadcast)."""

from __future__ import annotations

import json
from pathlib import Path

from rlslurm.diag.collectives import Entry, RankRecord, attribute, parse, read
from rlslurm.rundir import read_jsonl

DATA = Path(__file__).resolve().parents[1] / "data" / "diag" / "desync"

# torch 2.13.0+cpu, gloo, TORCH_FR_BUFFER_SIZE=100, POST /handler/fr_trace_json on rank 1's WorkerServer;
# the first of its three completed all_reduce entries kept, the in-flight broadcast whole.
CAPTURED = """{"comm_lib_version":"","entries":[{"collective_seq_id":3,"input_dtypes":["Float"],
"input_sizes":[[10]],"is_p2p":false,"op_id":3,"output_dtypes":["Float"],"output_sizes":[[10]],"p2p_seq_id":0,
"pg_id":0,"process_group":["0","default_pg"],"profiling_name":"gloo:all_reduce","record_id":2,"retired":true,
"state":"scheduled","thread_id":"140367127608192","thread_name":"python","time_created_ns":1796143656453581583,
"time_discovered_completed_ns":0,"time_discovered_started_ns":0,"timeout_ms":1800000},{"collective_seq_id":4,
"input_dtypes":["Float"],"input_sizes":[[5]],"is_p2p":false,"op_id":4,"output_dtypes":["Float"],
"output_sizes":[[5]],"p2p_seq_id":0,"pg_id":0,"process_group":["0","default_pg"],"profiling_name":"gloo:broadcast",
"record_id":3,"retired":false,"state":"scheduled","thread_id":"140367127608192","thread_name":"python",
"time_created_ns":1796143656457096290,"time_discovered_completed_ns":0,"time_discovered_started_ns":0,
"timeout_ms":1800000}],"nccl_comm_state":{},"pg_config":{"":{"desc":"","name":"","ranks":"[0, 1]"}},
"pg_status":{"0":{"last_completed_collective":"3","last_enqueued_collective":"4","last_started_collective":"-1"}},
"version":"2.10"}"""


def rank(name: str, *entries: tuple) -> RankRecord:
    return RankRecord(name, {"default_pg": [Entry(seq, op, sizes, done) for seq, op, sizes, done in entries]})


STEP = [("all_reduce", [[3]]), ("all_reduce", [[321]]), ("all_reduce", [[]])]  # boundary, DDP grads, loss


def steps(first_seq: int, ops: list[tuple[str, list]], open_last: bool = True) -> list[tuple]:
    out = [(first_seq + i, op, sizes, True) for i, (op, sizes) in enumerate(ops)]
    if open_last:
        out[-1] = (*out[-1][:3], False)
    return out


def test_the_captured_answer_parses_to_op_sequence_sizes_and_completion():
    record = parse("train-1", json.loads(CAPTURED))
    assert record.groups["default_pg"] == [Entry(3, "all_reduce", [[10]], True), Entry(4, "broadcast", [[5]], False)]
    assert record.last().what == "broadcast #4 (sizes [[5]])"


def test_a_rank_that_skipped_a_collective_is_named_with_the_one_it_skipped():
    a = rank("train-0", *steps(10, STEP + STEP[:1]))        # loss #12 done (with a short peer), boundary #13 open
    b = rank("train-1", *steps(10, STEP[:2] + STEP[:1]))    # skipped the loss: its #12 is the next boundary
    who = attribute([a, b])
    assert (who.verdict, who.ranks, who.op, who.seq) == ("skipped", ["train-1"], "all_reduce", 12)
    assert who.message.startswith("train-1 skipped all_reduce #12 (sizes [[]]) that train-0 entered")
    assert attribute([b, a]) == who  # whatever order the agent read them in


def test_with_three_ranks_the_odd_one_out_is_named_when_no_skip_explains_it():
    same = steps(5, [STEP[0], ("broadcast", [[8]])])
    odd = steps(5, [STEP[0], ("all_gather", [[8]])])
    who = attribute([rank("train-0", *same), rank("train-1", *odd), rank("train-2", *same)])
    assert (who.verdict, who.ranks, who.op, who.seq) == ("desync", ["train-1"], "all_gather", 6)
    both = attribute([rank("train-0", *same), rank("train-1", *odd)])
    assert both.verdict == "desync" and both.ranks == ["train-0", "train-1"] and "#6" in both.message


def test_a_rank_stuck_before_a_collective_is_behind():
    waiting = rank("train-0", *steps(20, STEP + STEP[:2]))       # in DDP's all_reduce #24
    behind = rank("train-1", *steps(20, STEP + STEP[:1], open_last=False))  # boundary #23 done, then its data
    who = attribute([waiting, behind])
    assert (who.verdict, who.ranks, who.op, who.seq) == ("behind", ["train-1"], "all_reduce", 24)
    assert who.message == ("train-1 is behind: last collective all_reduce #23 (sizes [[3]]), completed; train-0 "
                           "entered all_reduce #24 (sizes [[321]])")


def test_ranks_that_agree_and_are_level_blame_nobody_and_one_record_compares_nothing():
    a, b = rank("train-0", *steps(1, STEP)), rank("train-1", *steps(1, STEP))
    assert attribute([a, b]) is None and attribute([a]) is None and attribute([]) is None


def test_the_recorded_desync_names_the_rank_op_and_sequence_number_the_fault_skipped():
    (fault,) = [e for e in read_jsonl(DATA / "run" / "events.jsonl") if e["kind"] == "fault_injected"]
    (records,) = [p for p in (DATA / "collectives").glob("*/*.json")]
    who = attribute(read(records))
    assert (who.verdict, who.ranks, who.op, who.seq) == ("skipped", ["train-1"], fault["op"], fault["seq"])
