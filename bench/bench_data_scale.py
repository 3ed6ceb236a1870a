"""What a large dataset costs a rank: memory and time to the first step, SFT on 10k and 1M parquet rows.

    python bench/bench_data_scale.py                          # 10k and 1M rows, 2 ranks, a fresh datasets cache
    python bench/bench_data_scale.py --rows 10000 1000000 --ranks 2 --json-out /tmp/data-scale.json

Each row count: a parquet of TRL prompt/completion rows ("37+45=" -> "82") written with pyarrow (row groups of
64k), then `rlslurm submit` of an SFT job on it (the embedded tiny model, `data.train` = the parquet, `data.eval`
= 200 rows apart, 3 steps) through `--backend local` as a user runs it, with HF_DATASETS_CACHE a fresh directory
(the cold start: `datasets` converts the parquet into its Arrow cache once, under a lock the ranks share).
While it runs, every trainer rank's memory is sampled from /proc (psutil): peak RSS and peak PSS (PSS splits
pages shared between the ranks, such as the memory-mapped Arrow file, among them: the rank's fair share).
Printed per row count: parquet size, time from submit to the first trained step, peak RSS and PSS per rank,
and the same for the smaller run as the baseline: what 100x the rows adds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_rows(path: Path, rows: int, seed: int = 0, group: int = 65536) -> None:
    """`rows` prompt/completion rows as parquet, written a row group at a time (the writer holds one)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    schema = pa.schema([("prompt", pa.string()), ("completion", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, group):
            n = min(group, rows - start)
            pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n)]
            writer.write_table(pa.table({"prompt": [f"{a}+{b}=" for a, b in pairs],
                                         "completion": [str(a + b) for a, b in pairs]}, schema=schema))


def _rlslurm() -> str:
    here = Path(sys.executable).with_name("rlslurm")
    return str(here) if here.exists() else "rlslurm"


def _rank_pids(run: Path) -> list[int]:
    placement = run / "placement.jsonl"
    if not placement.exists():
        return []
    rows = [json.loads(line) for line in placement.read_text().splitlines() if line.strip()]
    return [r["pid"] for r in rows if r.get("role") == "train"]


def _first_step_t(run: Path) -> float | None:
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return None
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written
        if record.get("kind") == "sft_step":
            return record["t"]
    return None


def measure(rows: int, ranks: int, work: Path) -> dict:
    import psutil

    data = work / f"rows-{rows}.parquet"
    t = time.monotonic()
    write_rows(data, rows)
    write_s = time.monotonic() - t
    held = work / "eval.jsonl"
    held.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n"
                            for a, b in [(i % 100, (7 * i) % 100) for i in range(200)]))
    cache = Path(tempfile.mkdtemp(prefix="hf-cache-", dir=work))
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache)}
    argv = [_rlslurm(), "submit", "examples/sft-jsonl.yaml", "--backend", "local", "--run-root", str(work / "runs"),
            "--set", f"data.train={data}", "--set", f"data.eval={held}", "--set", "data.eval_fraction=null",
            "--set", "train.steps=3", "--set", "train.warmup_steps=1", "--set", f"hardware.gpus_per_node={ranks}",
            "--set", "job.name=data-scale"]
    before = set((work / "runs").glob("data-scale-*"))
    started = time.time()
    proc = subprocess.Popen(argv + ["--wait"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    peak_rss: dict[int, int] = {}
    peak_pss: dict[int, int] = {}
    run = None
    while proc.poll() is None:
        if run is None:
            found = sorted(set((work / "runs").glob("data-scale-*")) - before)
            run = found[-1] if found else None
        for pid in _rank_pids(run) if run else []:
            try:
                mem = psutil.Process(pid).memory_full_info()
            except psutil.Error:
                continue
            peak_rss[pid] = max(peak_rss.get(pid, 0), mem.rss)
            peak_pss[pid] = max(peak_pss.get(pid, 0), mem.pss)
        time.sleep(0.2)
    out = proc.stdout.read()
    if proc.returncode != 0 or run is None:
        raise SystemExit(f"{rows} rows: submit exited {proc.returncode}:\n{out[-3000:]}")
    first = _first_step_t(run)
    return {"rows": rows, "parquet_mb": data.stat().st_size / 1e6, "write_s": write_s,
            "first_step_s": (first - started) if first else None, "ranks": len(peak_rss),
            "peak_rss_mb": max(peak_rss.values(), default=0) / 1e6,
            "peak_pss_mb": max(peak_pss.values(), default=0) / 1e6,
            "cache_mb": sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 1e6,
            "load": os.getloadavg()[0], "run_dir": str(run)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[10_000, 1_000_000])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--work", type=Path, help="where the parquet, cache and runs go (default: a temp dir)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    print(f"{'rows':>9} {'parquet MB':>10} {'cache MB':>8} {'submit->1st step s':>18} {'peak RSS/rank MB':>16} "
          f"{'peak PSS/rank MB':>16} {'load':>5}")
    for rows in args.rows:
        r = measure(rows, args.ranks, work)
        results.append(r)
        print(f"{r['rows']:>9} {r['parquet_mb']:>10.1f} {r['cache_mb']:>8.1f} {r['first_step_s']:>18.1f} "
              f"{r['peak_rss_mb']:>16.0f} {r['peak_pss_mb']:>16.0f} {r['load']:>5.1f}", flush=True)
    if len(results) > 1:
        a, b = results[0], results[-1]
        print(f"{b['rows'] // a['rows']}x the rows: peak RSS per rank x{b['peak_rss_mb'] / a['peak_rss_mb']:.2f}, "
              f"PSS x{b['peak_pss_mb'] / a['peak_pss_mb']:.2f}, time to the first step x"
              f"{b['first_step_s'] / a['first_step_s']:.2f}")
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
