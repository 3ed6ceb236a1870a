"""What one very long row costs `rlslurm validate` before it is named: wall time and peak RSS, against the same file
without it (the command's own start: Python, torch, transformers).

    python bench/bench_long_row.py                   # rows of 5 and 50 MB in an SFT jsonl
    python bench/bench_long_row.py --mb 50 --json-out /tmp/long-row.json

Each size: a .jsonl of five ordinary prompt/completion rows after one whose prompt is `--mb` MB of arithmetic text
("12+7=" repeated: characters the embedded tokenizer knows), and an SFT job on it (the embedded model, 128
positions); `rlslurm validate` runs as a user runs it, its peak RSS read from the kernel (the child's ru_maxrss).
Before issue 37 the row was tokenized whole first: 5 MB took 2.26 GB, 50 MB 115 s and 19.2 GB (measured by the
issue's attack run); now it is refused by its bytes (rlslurm/textbound.py) before a tokenizer runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rlslurm() -> str:
    here = Path(sys.executable).with_name("rlslurm")
    return str(here) if here.exists() else "rlslurm"


def _validate(job: Path) -> dict:
    """Wall seconds, peak RSS (MB) and the last line of one `rlslurm validate` of `job`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.monotonic()
    done = subprocess.run([_rlslurm(), "validate", str(job)], capture_output=True, text=True, cwd=job.parent)
    seconds = time.monotonic() - started
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out = (done.stdout + done.stderr).strip().splitlines()
    return {"seconds": seconds, "peak_rss_mb": peak_kb / 1024 if peak_kb > before else None, "exit": done.returncode,
            "said": out[-1][:300] if out else ""}


def measure(mb: int, work: Path) -> dict:
    rows = [{"prompt": "1+1=", "completion": "2"}] * 5
    data = work / f"long-{mb}.jsonl"
    unit = "12+7="
    with data.open("w") as f:
        f.write(json.dumps({"prompt": unit * (mb * 10**6 // len(unit)), "completion": "19"}) + "\n")
        f.writelines(json.dumps(r) + "\n" for r in rows)
    job = work / f"long-{mb}.yaml"
    job.write_text(f"job: {{kind: sft}}\ndata: {{train: {data.name}, eval_fraction: 0.2}}\n")
    return {"mb": mb, "file_mb": data.stat().st_size / 1e6, **_validate(job)}


def baseline(work: Path) -> dict:
    data = work / "short.jsonl"
    data.write_text("".join(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n" for _ in range(6)))
    job = work / "short.yaml"
    job.write_text(f"job: {{kind: sft}}\ndata: {{train: {data.name}, eval_fraction: 0.2}}\n")
    return {"mb": 0, "file_mb": data.stat().st_size / 1e6, **_validate(job)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, nargs="+", default=[5, 50], help="sizes of the long row, MB")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # Each run in a process of its own, so ru_maxrss (a maximum over all children so far) is its own.
        results = []
        for size in [0, *args.mb]:
            code = ("import json, sys; from pathlib import Path; sys.path.insert(0, %r); import bench_long_row as b; "
                    "print(json.dumps(b.%s))" % (str(Path(__file__).parent),
                                                 f"baseline(Path({tmp!r}))" if size == 0 else
                                                 f"measure({size}, Path({tmp!r}))"))
            line = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            results.append(json.loads(line.strip().splitlines()[-1]))
    load = os.getloadavg()[0]
    print("| long row | rlslurm validate | peak RSS | said |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {'none (baseline)' if r['mb'] == 0 else str(r['mb']) + ' MB'} | {r['seconds']:.2f} s | "
              f"{r['peak_rss_mb']:.0f} MB | {r['said'][:120]} |")
    print(f"(load average {load:.2f})")
    if args.json_out:
        args.json_out.write_text(json.dumps({"results": results, "load": load}, indent=2))


if __name__ == "__main__":
    main()
