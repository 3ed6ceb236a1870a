"""Pure parsers for what SLURM prints; no subprocesses here (those are in commands.py).

    expand_nodelist("n[1-3,5],m7")          -> ["n1", "n2", "n3", "n5", "m7"]
    parsable2("JobID|State\\n7|RUNNING\\n")  -> [{"JobID": "7", "State": "RUNNING"}]
    scontrol_show("JobId=7 JobName=x ...")  -> [{"JobId": "7", "JobName": "x", ...}]   (one per het component)
    squeue_format(text, fields)             -> rows of `squeue --Format=F:|,...`
    sbatch_parsable("7;cluster\\n")          -> SbatchId(job_id="7", cluster="cluster")
    jobcomp_line("JobId=7 ... JobState=COMPLETED ...") -> {"JobId": "7", ...}
    split_job_id("7+1")                     -> ("7", 1)
    job_state(records)                      -> "TIMEOUT" (of scontrol_show / parsable2 / jobcomp_line records)
    sinfo_node_states("n1|idle\nn3|down*\n") -> {"n1": "idle", "n3": "down"}
    accounting_disabled(sacct_stderr)       -> True where sacct has no database (then `sacct -c`)
    job_unknown(stderr)                     -> True for "Invalid job id specified" (slurmctld answered)
    already_pending(stderr)                 -> True for a requeue of a job that another party requeued first
    srun_task_ends(srun_stderr)             -> [TaskEnd(node="n1", task=1, how="Killed", signal="SIGKILL"), ...]

Anything these do not understand raises `SlurmParseError` quoting the input, never a guess. Tests:
tests/unit/test_slurm_parse.py (tables of real outputs from the local cluster and SLURM's docs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from rlslurm.errors import SlurmParseError

_EMPTY_NODELISTS = {"", "(null)", "None assigned", "None"}
_HOST_GROUP = re.compile(r"([^,\[\]]*)(?:\[([^\[\]]*)\])?")
# A key of `scontrol show` / jobcomp output: `JobId=`, `Socks/Node=`, `NtasksPerN:B:S:C=`, `TRES=` ...
_KEY = re.compile(r"^([A-Za-z][A-Za-z0-9_/:.\-]*)=(.*)$", re.S)


def _ranges(body: str, where: str) -> list[str]:
    """`1-3,5,08-10` -> ["1", "2", "3", "5", "08", "09", "10"] (zero padding kept, as SLURM does)."""
    out: list[str] = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise SlurmParseError(f"bad range {part!r} in node list {where!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise SlurmParseError(f"descending range {part!r} in node list {where!r}")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets: `n[1-2],m[3,5]` -> [`n[1-2]`, `m[3,5]`]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmParseError(f"nested '[' in node list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmParseError(f"unbalanced ']' in node list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmParseError(f"unclosed '[' in node list {text!r}")
    parts.append(text[start:])
    return parts


def expand_nodelist(text: str) -> list[str]:
    """Host names of a SLURM node list (`n[1-3,5],m7`, `rack[1-2]-gpu[01-02]`); empty for `(null)`."""
    text = text.strip()
    if text in _EMPTY_NODELISTS:
        return []
    hosts: list[str] = []
    for part in _split_top_level(text):
        if not part or any(c.isspace() for c in part):
            raise SlurmParseError(f"empty or blank host in node list {text!r}")
        names = [""]
        pos = 0
        while pos < len(part):
            m = _HOST_GROUP.match(part, pos)
            if m is None or m.end() == pos:
                raise SlurmParseError(f"cannot read node list {text!r} at {part[pos:]!r}")
            prefix, body = m.group(1), m.group(2)
            choices = _ranges(body, text) if body is not None else [""]
            names = [n + prefix + c for n in names for c in choices]
            pos = m.end()
        hosts += names
    return hosts


def parsable2(text: str) -> list[dict[str, str]]:
    """Rows of `sacct/sinfo --parsable2` (a header line, then `|`-separated rows, no trailing `|`)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    header = lines[0].split("|")
    if any(not h for h in header):
        raise SlurmParseError(f"--parsable2 header has an empty column name: {lines[0]!r}")
    rows = []
    for ln in lines[1:]:
        cells = ln.split("|")
        if len(cells) != len(header):
            raise SlurmParseError(f"--parsable2 row has {len(cells)} cells, header has {len(header)}: {ln!r}")
        rows.append(dict(zip(header, cells)))
    return rows


def key_values(text: str) -> dict[str, str]:
    """`Key=value Key2=v a l u e` -> dict; a token without `Key=` continues the previous value (a path
    with spaces, a Reason with words)."""
    record: dict[str, str] = {}
    last = None
    for token in text.split():
        m = _KEY.match(token)
        if m:
            last = m.group(1)
            record[last] = m.group(2)
        elif last is None:
            raise SlurmParseError(f"expected Key=value, got {token!r} in {text[:200]!r}")
        else:
            record[last] += " " + token
    return record


def scontrol_show(text: str) -> list[dict[str, str]]:
    """Records of `scontrol show job|node|partition` (with or without -o): one dict per record, so a het
    job gives one per component (HetJobId, HetJobOffset set)."""
    text = text.strip()
    if not text or text.startswith("No jobs in the system"):
        return []
    lines = text.splitlines()
    if any(ln[:1].isspace() for ln in lines):  # multi-line form: indented lines, blank line between records
        chunks = re.split(r"\n\s*\n", text)
    else:  # -o form: one record per line
        chunks = lines
    records = [key_values(c) for c in chunks if c.strip()]
    for r in records:
        if not r:
            raise SlurmParseError(f"empty scontrol record in {text[:200]!r}")
    return records


def squeue_format(text: str, fields: Sequence[str]) -> list[dict[str, str]]:
    """Rows of `squeue --noheader --Format=F1:|,F2:|,...` (each cell ends with `|`)."""
    rows = []
    for ln in text.splitlines():
        if not ln.strip():
            continue
        cells = ln.rstrip("\n").split("|")
        if cells[-1].strip():
            raise SlurmParseError(f"squeue row does not end with '|': {ln!r}")
        cells = [c.strip() for c in cells[:-1]]
        if len(cells) != len(fields):
            raise SlurmParseError(f"squeue row has {len(cells)} cells for {len(fields)} fields {list(fields)}: {ln!r}")
        rows.append(dict(zip(fields, cells)))
    return rows


@dataclass(frozen=True)
class SbatchId:
    """What `sbatch --parsable` printed: the job id and, on a federation / multi-cluster, the cluster."""

    job_id: str
    cluster: str | None = None


def sbatch_parsable(text: str) -> SbatchId:
    """`12` or `12;cluster` (from --parsable); also accepts the plain `Submitted batch job 12`."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise SlurmParseError("sbatch printed nothing (expected a job id)")
    last = lines[-1]  # sbatch may print warnings first
    m = re.fullmatch(r"(?:Submitted batch job )?(\d+)(?:;(\S+))?", last)
    if not m:
        raise SlurmParseError(f"cannot find a job id in sbatch output {text!r}")
    return SbatchId(m.group(1), m.group(2))


def jobcomp_line(line: str) -> dict[str, str]:
    """One line of jobcomp/filetxt (`JobId=7 UserId=root(0) ... JobState=COMPLETED ...`)."""
    record = key_values(line)
    if "JobId" not in record or "JobState" not in record:
        raise SlurmParseError(f"jobcomp line lacks JobId or JobState: {line[:200]!r}")
    return record


def split_job_id(text: str) -> tuple[str, int | None]:
    """`7` -> ("7", None); `7+1` (a het component, as squeue and sacct print it) -> ("7", 1)."""
    m = re.fullmatch(r"(\d+)(?:\+(\d+))?", text.strip())
    if not m:
        raise SlurmParseError(f"not a job id: {text!r}")
    return m.group(1), (int(m.group(2)) if m.group(2) is not None else None)


def job_state(records: Sequence[Mapping[str, str]]) -> str | None:
    """A job's state from its first record (a het job's component 0): `JobState` of `scontrol show job` and
    jobcomp, `State` of sacct, whose first word it is (`CANCELLED by 0` -> CANCELLED). None when there is no
    record or the state is blank (`sacct -c` shifts the fields of a job name with a space)."""
    if not records:
        return None
    words = (records[0].get("JobState") or records[0].get("State") or "").split()
    return words[0] if words else None


def job_unknown(stderr: str) -> bool:
    """Whether a SLURM command failed because slurmctld does not know the job (gone past MinJobAge, or never
    was): an answer, unlike a controller that cannot be reached (`Unable to contact slurm controller`)."""
    return "Invalid job id" in stderr


def already_pending(stderr: str) -> bool:
    """Whether `scontrol requeue` failed because the job is pending again already: another party of the job
    (the hang watchdog, the leader's drain, SLURM's own requeue) requeued it first."""
    return "Job is pending execution" in stderr


def accounting_disabled(sacct_stderr: str) -> bool:
    """Whether sacct failed for want of an accounting database (`sacct -c` reads the jobcomp file instead)."""
    return "accounting storage is disabled" in sacct_stderr


_NODE_STATE_FLAGS = "*~#!%$@^-"
"""Suffixes `sinfo %t` adds to a node's state (man sinfo, NODE STATE CODES): * not responding, ~ powered
off, # powering up, ! pending power down, % powering down, $ maintenance, @ pending reboot, ^ rebooting,
- planned."""


def sinfo_node_states(text: str) -> dict[str, str]:
    """node -> state of `sinfo --Node --noheader --format=%N|%t` (a node in two partitions is listed twice;
    its state is the same), the state without its flag suffixes."""
    states: dict[str, str] = {}
    for ln in text.split():
        name, sep, state = ln.partition("|")
        if not sep or not name or not state:
            raise SlurmParseError(f"sinfo line is not NODE|STATE: {ln!r}")
        states[name] = state.rstrip(_NODE_STATE_FLAGS)
    return states


_SRUN_TASK = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+?)\s*$")
_SRUN_STEP_SIGNAL = re.compile(r"_step_signal: Terminating StepId=|Force Terminated StepId=")
_SRUN_SIGNALS = {"Killed": "SIGKILL", "Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
                 "Terminated": "SIGTERM", "Illegal instruction": "SIGILL", "Floating point exception": "SIGFPE",
                 "Out Of Memory": "OOM"}
"""How srun names a task's end by a signal (strsignal's words; "Out Of Memory" where the OOM killer struck)."""


@dataclass(frozen=True)
class TaskEnd:
    """One task's abnormal end as srun reported it on its stderr."""

    node: str
    task: int
    how: str
    """srun's words: `Killed`, `Segmentation fault`, `Exited with exit code 3`, ..."""
    signal: str | None
    """SIGKILL, SIGSEGV, ... (OOM for the OOM killer); None for an exit with a code."""
    after_step_signal: bool
    """Reported after srun began terminating the step (--kill-on-bad-exit): a peer it ended, not a cause."""


_SRUN_WAIT_FIRED = re.compile(r"^srun: First task exited (\d+)s ago\s*$")
_SRUN_WAIT_TASKS = re.compile(r"^srun: StepId=\S+ tasks? (?P<tasks>[\d,\-]+): (?P<state>running|exited)\s*$")


@dataclass(frozen=True)
class WaitExpired:
    """srun's `--wait=S` fired: S seconds after the step's first task exited, some still ran and srun ended them."""

    after_s: int
    exited: tuple[int, ...]
    running: tuple[int, ...]
    """The tasks srun then terminated."""


def srun_wait_expired(text: str) -> WaitExpired | None:
    """srun's report that its `--wait` ran out (`First task exited 4s ago`, then `StepId=J.S tasks 1-3: running`
    and `task 0: exited`; captured: tests/unit/slurm_outputs/srun_wait_expired*.stderr.txt), or None."""
    fired, exited, running = None, [], []
    for line in text.splitlines():
        line = line.strip()
        if (m := _SRUN_WAIT_FIRED.match(line)) and fired is None:
            fired = int(m.group(1))
        elif fired is not None and (m := _SRUN_WAIT_TASKS.match(line)):
            tasks = [int(t[1:]) for t in expand_nodelist(f"t[{m.group('tasks')}]")]
            (running if m.group("state") == "running" else exited).extend(tasks)
    if fired is None:
        return None
    return WaitExpired(after_s=fired, exited=tuple(sorted(exited)), running=tuple(sorted(running)))


def srun_task_ends(text: str) -> list[TaskEnd]:
    """Every `srun: error: NODE: task N: HOW` line of srun's stderr, in order. With --kill-on-bad-exit the
    first task that ended badly is the cause; srun then terminates the step (`_step_signal: Terminating
    StepId=...`) and reports its peers `Terminated` (captured: tests/unit/slurm_outputs/srun_*.stderr.txt).
    Lines that are not srun's task reports are skipped (srun's stderr carries the tasks' own stderr too)."""
    ends: list[TaskEnd] = []
    signalled = False
    for line in text.splitlines():
        if _SRUN_STEP_SIGNAL.search(line):
            signalled = True
            continue
        m = _SRUN_TASK.match(line.strip())
        if not m:
            continue
        how = m.group("how")
        if how.endswith(" (core dumped)"):
            how = how[: -len(" (core dumped)")]
        sig = _SRUN_SIGNALS.get(how)
        if sig is None and not how.startswith("Exited with exit code"):
            sig = how  # a signal srun names in words this table lacks: still a death by signal
        for task in expand_nodelist(f"t[{m.group('tasks')}]"):
            ends.append(TaskEnd(node=m.group("node"), task=int(task[1:]), how=how, signal=sig,
                                after_step_signal=signalled))
    return ends
