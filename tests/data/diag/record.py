"""Record a real run of each failure `rlslurm diag` names, for the classifier's tests.

    .venv/bin/python tests/data/diag/record.py                      # every local cause (~8 min on 2 busy cores)
    .venv/bin/python tests/data/diag/record.py reward_down hang     # some of them
    RLSLURM_SLURM_PORT_BASE=31817 .venv/bin/python tests/data/diag/record.py --cluster   # + the SLURM causes (root)

Each cause's run is made for real by tests/integration/failures.py (its docstring says how, and the two
facts that are planted); then `rlslurm diag`'s own collector (diag/bundle.py: redacted, log tails) bundles
it, the classifier must name the cause the run was made for (else nothing is written), and the bundle's
evidence goes to tests/data/diag/<cause>/:

    run/events.jsonl, run/config.yaml     the run's events, resolved config and layout (what the plan
    run/layout.json                       decided: placement, sync method, engines)
    heartbeats/*.json, env/*.json         every process's last heartbeat and env fingerprint
    logs/**.tail                          the last LOG_LINES lines of every log (not submitit's pickles)
    collectives/                          the ranks' flight-recorder records the node agent read on a hang
    recorded.json                         what no file holds: when (`recorded_at`), on which host, which
                                          heartbeats' processes were alive then, SLURM's state of the job,
                                          how the run was made, and the headline diag printed

No weights, checkpoints or stacks are kept. tests/unit/test_diag_recorded.py replays each directory through
the classifier (tests/data/diag/README.md lists what is there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests")]  # failures.py, and its waiting.py

import failures  # noqa: E402  (tests/integration/failures.py)
from rlslurm.diag.bundle import collect  # noqa: E402
from rlslurm.diag.heartbeat import pid_alive, read_heartbeats  # noqa: E402
from rlslurm.node import node_name  # noqa: E402
from rlslurm.rundir import RunDir  # noqa: E402

LOG_LINES = 60
"""Lines kept of each log: the cause is in the tail, and the files stay small."""
KEPT = ("run/events.jsonl", "run/config.yaml", "run/layout.json", "heartbeats/", "env/", "logs/", "collectives/")


def record(cause: str, made: failures.Made, how, out_root: Path = HERE) -> dict:
    """Bundle `made.run` as `rlslurm diag` does, check the cause, and write tests/data/diag/<cause>/."""
    run = RunDir(made.run)
    alive = sorted(hb["file"] for hb in read_heartbeats(run) if hb.get("host") == node_name() and pid_alive(hb))
    with tempfile.TemporaryDirectory() as tmp:
        bundle = collect(run.path, out_dir=Path(tmp), live=False, slurm=made.slurm, log_tail_lines=LOG_LINES)
        recorded_at = time.time()
        if bundle.causes[0].kind != cause:
            raise SystemExit(f"{cause}: diag named {bundle.causes[0].kind!r} for {run.path}, not {cause!r}:\n"
                             f"{bundle.summary}")
        out = out_root / cause
        shutil.rmtree(out, ignore_errors=True)
        with tarfile.open(bundle.path) as tar:
            for member in tar.getmembers():
                name = member.name.split("/", 1)[1]
                if member.isfile() and name.startswith(KEPT) and ".pkl" not in name:  # submitit's pickles: no log
                    (out / name).parent.mkdir(parents=True, exist_ok=True)
                    (out / name).write_bytes(tar.extractfile(member).read())
        summary = json.loads(tar_member(bundle.path, "summary.json"))
    meta = {"cause": cause, "made_by": f"tests/integration/failures.py:{how.__name__}",
            "made_how": " ".join((how.__doc__ or "").split()), "recorded_at": recorded_at, "host": node_name(),
            "alive": alive, "slurm_state": summary["slurm_state"], "headline": bundle.causes[0].headline}
    (out / "recorded.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def tar_member(path: Path, suffix: str) -> str:
    with tarfile.open(path) as tar:
        (member,) = [m for m in tar.getmembers() if m.name.endswith("/" + suffix)]
        return tar.extractfile(member).read().decode()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("causes", nargs="*", help=f"some of: {', '.join({**failures.LOCAL, **failures.CLUSTER})} "
                                             "(default: every local one; with --cluster, every one)")
    p.add_argument("--cluster", action="store_true",
                   help="start a local Slurm (root; RLSLURM_SLURM_PORT_BASE) for the causes only SLURM makes")
    p.add_argument("--keep", action="store_true", help="keep the scratch run directories (printed)")
    args = p.parse_args(argv)
    scenarios = {**failures.LOCAL, **(failures.CLUSTER if args.cluster else {})}
    causes = args.causes or list(scenarios)
    unknown = sorted(set(causes) - set(scenarios))
    if unknown:
        p.error(f"no scenario for {unknown} here; known: {', '.join(scenarios)}"
                + ("" if args.cluster else f" (--cluster adds {', '.join(failures.CLUSTER)})"))
    scratch = Path(tempfile.mkdtemp(prefix="rlslurm-record-"))
    cluster = None
    try:
        if args.cluster:
            from rlslurm.slurm.localcluster import LocalCluster

            cluster = LocalCluster(scratch / "slurm")
            cluster.up(timeout_s=60)
            os.environ.update(cluster.env)  # every SLURM client (and submitit) reads SLURM_CONF
        for cause in causes:
            started = time.monotonic()
            (scratch / cause).mkdir(parents=True)
            made = scenarios[cause](scratch / cause)
            try:
                meta = record(cause, made, scenarios[cause])
            finally:
                made.close()
            print(f"{cause}: {meta['headline']} ({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        if cluster is not None:
            cluster.down()
        if args.keep:
            print(f"scratch runs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
