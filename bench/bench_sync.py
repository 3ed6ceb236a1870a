"""Weight-sync bench: each sync method against the raw transport it rides on, in one run.

    python bench/bench_sync.py            # ~210 MB model, 8 timed syncs per method (~35 s on 2 cores)
    python bench/bench_sync.py --quick    # ~105 MB model, 4 timed syncs per method (~16 s)

A synthetic Llama (hidden 512, float32) is saved in Hugging Face layout and served by one real engine
server process (rlslurm/rollout/server.py, 1 torch thread). For each method the full protocol runs
(DRAIN -> UPDATE -> VERIFY -> RESUME, rlslurm/sync/protocol.py) with another seed's weights, and the
raw transport moves the same bytes with nothing around it:

    disk       vs  safetensors save_file + fsync + load_file of the same tensors (this process)
    broadcast  vs  one gloo broadcast of one flat uint8 buffer of the same bytes to a peer process,
                   plus a 1-element all-reduce as the receipt (what the engine's HTTP answer is)
    ipc        vs  two copies of one flat buffer through a /dev/shm-backed tensor (in, then out):
                   the floor of any same-host handoff

Ratios (goals from the issue):
    update efficiency = raw seconds / protocol UPDATE seconds          goal >= 0.8
    protocol overhead = (whole sync() - UPDATE) / UPDATE               goal <= 10 %
      i.e. the trainer's checksums + DRAIN + VERIFY (engine checksums) + RESUME, per byte moved.

`run(quick)` returns the numbers as a dict (bench/run_all.py calls it); `main` prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GOAL_EFFICIENCY = 0.8
GOAL_OVERHEAD = 0.10
PEER = """
import os, sys, torch
from rlslurm.sync.broadcast import BroadcastGroup
addr, port, nbytes, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
group = BroadcastGroup.join(addr, port, 1, 2, 120.0)
buf, ack = torch.empty(nbytes, dtype=torch.uint8), torch.zeros(1)
for _ in range(reps):
    group.broadcast(buf)
    group.pg.allreduce([ack]).wait()
# Gloo's destructors at interpreter exit race with the store's host going away and can abort
# ("terminate called without an active exception"); the work is done, so leave without them.
os._exit(0)
"""


def synthetic_model(layers: int, seed: int):
    from rlslurm.modelspec import ModelConfig
    from rlslurm.tinymodel import build_model
    from rlslurm.tokenizer import VOCAB

    return build_model(ModelConfig(hidden=512, ffn_hidden=1024, layers=layers, heads=8, vocab=len(VOCAB)), seed)


def served_weights(model) -> dict[str, torch.Tensor]:
    """Every tensor once (tied embeddings are one tensor), as the RL trainer sends them."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out[name] = t.detach().contiguous()
    return out


def raw_disk(tensors: dict, folder: Path, reps: int) -> float:
    from safetensors.torch import load_file, save_file

    times = []
    for i in range(reps + 1):
        path = folder / f"raw-{i}.safetensors"
        t0 = time.perf_counter()
        save_file(tensors, str(path))
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        back = load_file(str(path))
        times.append(time.perf_counter() - t0)
        del back
        path.unlink()
    return statistics.median(times[1:])  # the first one warms the allocator and the page cache


def raw_broadcast(nbytes: int, reps: int) -> float:
    from rlslurm.sync.broadcast import BroadcastGroup, free_port

    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", PEER, "127.0.0.1", str(port), str(nbytes), str(reps + 1)])
    try:
        group = BroadcastGroup.join("127.0.0.1", port, 0, 2, 120.0)
        buf, ack = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), torch.zeros(1)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            group.broadcast(buf)
            group.pg.allreduce([ack]).wait()
            times.append(time.perf_counter() - t0)
        if peer.wait(60) != 0:
            raise RuntimeError(f"raw broadcast peer exited with {peer.returncode}")
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    return statistics.median(times[1:])


def raw_ipc(nbytes: int, reps: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    shared = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        shared.copy_(src)
        dst.copy_(shared)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def protocol(method: str, tensors: dict, client, folder: Path, reps: int, version0: int) -> dict:
    """Median over `reps` timed syncs (after one warm-up that builds groups and shared buffers)."""
    from rlslurm.sync.config import SyncConfig
    from rlslurm.sync.protocol import WeightSync, transport_for

    cfg = SyncConfig(method=method, timeout_s=120.0)
    transport = transport_for(cfg, weights_dir=folder / "weights")
    sync = WeightSync([client], transport, cfg)
    rows = []
    try:
        for i in range(reps + 1):
            t0 = time.perf_counter()
            report = sync.sync(tensors, version=version0 + i)
            wall_s = time.perf_counter() - t0
            if report.attempts != 1:
                raise RuntimeError(f"{method}: sync needed {report.attempts} attempts (verify failed)")
            m = report.metrics()
            rows.append({"wall_s": wall_s, **{f"{s}_s": m[f"sync_{s}_s"] for s in ("drain", "update", "verify", "resume")}})
    finally:
        transport.close()
    timed = rows[1:]
    out = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    out["checksum_s"] = out["wall_s"] - sum(out[f"{s}_s"] for s in ("drain", "update", "verify", "resume"))
    return out


def run(quick: bool = False, log=print) -> dict:
    """Measure every method and its raw transport; returns {"model_mb", "methods": {name: {...}}}."""
    from rlslurm.rollout.client import spawn_engine
    from rlslurm.sync.broadcast import free_port
    from rlslurm.tinymodel import save_hf

    torch.set_num_threads(1)  # the engine has one thread too: compare like with like on a shared host
    layers, reps = (10, 4) if quick else (20, 8)
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        folder = Path(tmp)
        save_hf(synthetic_model(layers, seed=0), folder / "model")
        tensors = served_weights(synthetic_model(layers, seed=1))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        log(f"bench_sync: {nbytes / 1e6:.1f} MB in {len(tensors)} tensors, {reps} timed syncs per method")
        engine = spawn_engine(folder / "model", port=free_port(), log_path=folder / "engine.log",
                              extra_args=["--threads", "1"], env={"HF_HUB_OFFLINE": "1"})
        methods = {}
        try:
            raws = {"disk": lambda: raw_disk(tensors, folder, reps), "broadcast": lambda: raw_broadcast(nbytes, reps),
                    "ipc": lambda: raw_ipc(nbytes, reps)}
            for k, method in enumerate(("disk", "broadcast", "ipc")):
                proto = protocol(method, tensors, engine.client, folder, reps, version0=1 + k * (reps + 1))
                raw_s = raws[method]()
                methods[method] = {**proto, "raw_s": raw_s, "bytes": nbytes,
                                   "update_gbps": nbytes / proto["update_s"] / 1e9, "raw_gbps": nbytes / raw_s / 1e9,
                                   "efficiency": raw_s / proto["update_s"],
                                   "overhead_share": (proto["wall_s"] - proto["update_s"]) / proto["update_s"]}
                log(f"  {method}: update {proto['update_s']:.3f} s, raw {raw_s:.3f} s, sync {proto['wall_s']:.3f} s")
        finally:
            engine.stop()
    return {"model_mb": nbytes / 1e6, "reps": reps, "methods": methods}


def rows(result: dict) -> list[dict]:
    """Table rows (measure, values, ratio, goal, ok) for run_all and for main."""
    out = []
    for name, m in result["methods"].items():
        out.append({"measure": f"sync {name}: UPDATE vs raw transport (GB/s)",
                    "values": f"{m['update_gbps']:.2f} vs {m['raw_gbps']:.2f}",
                    "ratio": m["efficiency"], "goal": f">= {GOAL_EFFICIENCY}", "ok": m["efficiency"] >= GOAL_EFFICIENCY})
        around = m["wall_s"] - m["update_s"]
        out.append({"measure": f"sync {name}: checksums+drain+verify+resume / UPDATE",
                    "values": f"{around:.3f} s / {m['update_s']:.3f} s (cks {m['checksum_s']:.3f}, "
                              f"drain {m['drain_s']:.3f}, verify {m['verify_s']:.3f}, resume {m['resume_s']:.3f})",
                    "ratio": m["overhead_share"], "goal": f"<= {GOAL_OVERHEAD:.0%}", "ok": m["overhead_share"] <= GOAL_OVERHEAD})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer repetitions")
    args = ap.parse_args()
    result = run(args.quick)
    print(f"\nsync of {result['model_mb']:.1f} MB to one engine on loopback, median of {result['reps']}:")
    for r in rows(result):
        print(f"{r['measure']:<52} {r['values']:<70} {r['ratio']:7.3f}  goal {r['goal']:<6} {'ok' if r['ok'] else 'MISSED'}")


if __name__ == "__main__":
    main()
