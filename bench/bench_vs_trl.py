"""rlslurm against Hugging Face TRL's GRPOTrainer on the same job, side by side on this machine.

    pip install -e '.[bench]'             # TRL 1.16 (an extra for this bench only, never a runtime dependency)
    python bench/bench_vs_trl.py --make-export --steps 100 --seeds 0 1 2 --quiet-load 0.5 \\
        --results-md docs/results.md                            # the table in docs/results.md, with this command
    python bench/bench_vs_trl.py --export runs/tiny-sft-.../export/hf --steps 10 --seeds 0   # a quick check

Both sides train the demo's GRPO (examples/tiny-grpo.yaml) from one SFT export (`--export`, or `--make-export`:
examples/tiny-sft.yaml run first): the same prompts in the same order (drawn here by rlslurm's own sampler,
rlslurm/rl/draw.py's PromptStream, and checked against the rows each rlslurm step reports it drew), 8 samples
per prompt, the task's exact rule as the reward, one optimizer step per 512 samples, lr 3e-4 constant, clip 0.2,
no KL, the greedy held-out accuracy on the same 1,000 rows at the start and the end. TRL's GRPOConfig
(`trl_config`) is matched to the demo, with `shuffle_dataset=False` so it takes the rows in the order given.
rlslurm runs as `make demo` runs it (`rlslurm submit --backend local --wait`: trainer ranks, engine, supervisors,
node agent, checkpoints every 10 steps, verified weight sync), TRL in one process (torch's threads: every core).

Runs alternate (A/B, then B/A for the next pair) so the machine's drift hits both. Before each run the bench
waits up to --quiet-wait-s for the 1-minute load to fall to --quiet-load (when given) and records it, and the
mean load while it ran. Per run: median step (the cadence a user sees: time between two steps' ends,
checkpoints and boundaries included), samples/s over the steps, wall from launch to exit, time to first step
(from the process start, as the `first_step` event's since_process_start_s, and from launch), the largest
sum of PSS over every process of the side's tree (psutil, sampled every second), and the held-out accuracy.
rlslurm's modules are compiled first (`compiled_as_installed`), as an installed package's are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
MARK_START, MARK_END = "<!-- bench_vs_trl:start -->", "<!-- bench_vs_trl:end -->"


# -- the job both sides run ------------------------------------------------------------------------------

def job_inputs(steps: int, seed: int, sets: tuple[str, ...] = ()) -> dict:
    """The prompts of each step, in order, as rlslurm's sampler draws them, and the held-out rows."""
    from rlslurm.config import load_config
    from rlslurm.data.splits import load_splits
    from rlslurm.rl.draw import PromptStream

    job = load_config(EXAMPLE, [f"train.seed={seed}", f"train.steps={steps}", *sets])
    train, held_out = load_splits(job)
    stream = PromptStream(train, per_step=job.rl.prompts_per_step, seed=job.train.seed,
                          max_bad_share=job.data.max_bad_share)
    stream.resume(0, None)
    drawn = [stream.draw(step) for step in range(steps)]
    rows = [held_out.try_sample(i) for i in range(min(len(held_out), job.rl.eval_rows))]
    return {"prompts": [[s.prompt for s in d.samples] for d in drawn], "rows": [d.rows for d in drawn],
            "held_out": [s.prompt for s in rows], "k": job.rl.samples_per_prompt, "lr": job.train.lr,
            "clip": job.rl.clip_eps, "max_new_tokens": job.rollout.max_new_tokens,
            "temperature": job.rollout.temperature, "grad_clip": job.train.grad_clip}


# -- measuring a side's process tree ----------------------------------------------------------------------

class TreeMeter:
    """Samples the PSS of a process and all its descendants, and the load, until stopped."""

    # Once a second: a sample reads every process's smaps (~3 ms of CPU each), and at 4 a second the meter took
    # ~4 % of the 2 cores from rlslurm's 6 processes against ~1 % from TRL's one. The peak is a plateau.
    def __init__(self, pid: int, every_s: float = 1.0):
        self.pid, self.every_s = pid, every_s
        self.peak_mb, self.peak_procs, self.peak_names = 0.0, 0, []
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "TreeMeter":
        self._thread.start()
        return self

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            total, names = 0.0, []
            for p in procs:
                try:
                    mb = p.memory_full_info().pss / 2**20
                    total += mb
                    names.append(f"{mb:.0f} MB {' '.join(' '.join(p.cmdline()).split()[1:4])[:60] or p.name()}")
                except psutil.Error:
                    continue
            if total > self.peak_mb:
                self.peak_mb, self.peak_procs, self.peak_names = total, len(names), names
            self.loads.append(os.getloadavg()[0])
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def wait_quiet(limit: float | None, wait_s: float) -> float:
    """Wait (bounded) for the 1-minute load to fall to `limit`; returns the load at the start of the run."""
    deadline = time.monotonic() + wait_s
    while limit is not None and os.getloadavg()[0] > limit and time.monotonic() < deadline:
        print(f"  waiting for a quiet machine: load {os.getloadavg()[0]:.2f} > {limit}", file=sys.stderr, flush=True)
        time.sleep(15)
    return os.getloadavg()[0]


def _measured(argv: list[str], env: dict | None = None, cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess, dict]:
    launched = time.time()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    meter = TreeMeter(proc.pid).start()
    out, err = proc.communicate()
    meter.stop()
    done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{err[-3000:]}")
    return done, {"launched": launched, "wall_s": time.time() - launched, "pss_mb": meter.peak_mb,
                  "processes": meter.peak_procs, "process_names": meter.peak_names,
                  "load_during": statistics.mean(meter.loads) if meter.loads else os.getloadavg()[0]}


def _rlslurm() -> str:
    here = Path(sys.executable).with_name("rlslurm")
    return str(here) if here.exists() else "rlslurm"


def run_rlslurm(export: Path, steps: int, seed: int, inputs: dict, root: Path, sets: tuple[str, ...]) -> dict:
    argv = [_rlslurm(), "submit", str(EXAMPLE), "--backend", "local", "--run-root", str(root), "--wait",
            "--set", f"train.init_from={export}", "--set", f"train.seed={seed}", "--set", f"train.steps={steps}",
            "--set", f"rl.eval_every={steps}"]
    for s in sets:
        argv += ["--set", s]
    _, m = _measured(argv)
    run = max(root.glob("tiny-grpo-*"), key=lambda p: p.stat().st_mtime)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_ = [r for r in metrics if "step_s" in r]
    drew = [r.get("data_rows") for r in steps_]
    if drew != inputs["rows"][:len(drew)]:
        raise RuntimeError(f"{run}: rlslurm drew other rows than the bench dumped for TRL; the bench is wrong")
    first = next(json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
                 if '"first_step"' in line)
    ends = [r["t"] for r in steps_]
    start = ends[0] - steps_[0]["step_s"]
    evals = [r["held_out_accuracy"] for r in metrics if "held_out_accuracy" in r]
    return {**m, "side": "rlslurm", "seed": seed, "run": str(run), "step_ends": [t - start for t in ends],
            "first_step_s": first["since_process_start_s"], "first_step_from_launch_s": first["t"] - m["launched"],
            "held_out": evals[-1] if evals else None, "samples_per_step": steps_[0]["samples"]}


def run_trl(export: Path, steps: int, seed: int, inputs_file: Path, out: Path) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--trl-child", "--export", str(export), "--steps",
            str(steps), "--seeds", str(seed), "--inputs", str(inputs_file), "--child-out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    _, m = _measured(argv, env=env)
    child = json.loads(out.read_text())
    return {**m, **child, "side": "trl", "seed": seed,
            "first_step_from_launch_s": child["first_step_at"] - m["launched"]}


# -- the TRL side, in a process of its own ----------------------------------------------------------------

def trl_config(inputs: dict, steps: int, seed: int, output_dir: str):
    """TRL 1.16's GRPOConfig matched to examples/tiny-grpo.yaml (one optimizer step per 512 generations)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=64, gradient_accumulation_steps=8, steps_per_generation=8,
        num_generations=inputs["k"], max_completion_length=inputs["max_new_tokens"],
        temperature=inputs["temperature"], learning_rate=inputs["lr"], optim="adamw_torch", weight_decay=0.0,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=inputs["grad_clip"], beta=0.0,
        epsilon=inputs["clip"], loss_type="grpo", scale_rewards="group", bf16=False, fp16=False,
        gradient_checkpointing=False, use_cpu=True, seed=seed, shuffle_dataset=False, max_steps=steps,
        logging_steps=10**9, save_strategy="no", report_to="none", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0)


def trl_child(args) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rlslurm.evaluate import greedy_accuracy
    from rlslurm.lifetime import process_age_s
    from rlslurm.tasks.arithmetic import parse_prompt, score

    inputs = json.loads(Path(args.inputs).read_text())
    seed = args.seeds[0]
    model = AutoModelForCausalLM.from_pretrained(str(args.export), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(args.export))
    held_out = [parse_prompt(p) for p in inputs["held_out"]]
    before = greedy_accuracy(model, tokenizer, held_out, inputs["max_new_tokens"]).accuracy
    ends: list[float] = []
    ages: list[float] = []  # the process's age at each step's end, as rlslurm's first_step event measures it

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.begin = time.time()

        def on_step_end(self, *a, **k):
            ends.append(time.time())
            ages.append(process_age_s())

    def rule(prompts, completions, **_):
        return [score(parse_prompt(p), c) for p, c in zip(prompts, completions)]

    flat = [p for step in inputs["prompts"][:args.steps] for p in step]
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = GRPOTrainer(model=model, reward_funcs=rule, args=trl_config(inputs, args.steps, seed, tmp),
                              train_dataset=Dataset.from_dict({"prompt": flat}), processing_class=tokenizer,
                              callbacks=[clock])
        trainer.train()
    after = greedy_accuracy(trainer.model, tokenizer, held_out, inputs["max_new_tokens"]).accuracy
    Path(args.child_out).write_text(json.dumps({
        "step_ends": [t - clock.begin for t in ends], "first_step_s": ages[0], "first_step_at": ends[0],
        "held_out_start": before, "held_out": after, "samples_per_step": 64 * 8}))


# -- the table ----------------------------------------------------------------------------------------------

def summary(r: dict) -> dict:
    ends = r["step_ends"]
    gaps = [b - a for a, b in zip([0.0, *ends], ends)]
    return {"median_step_s": statistics.median(gaps), "samples_per_s": r["samples_per_step"] * len(ends) / ends[-1],
            "wall_s": r["wall_s"], "first_step_s": r["first_step_s"],
            "first_step_from_launch_s": r["first_step_from_launch_s"], "pss_mb": r["pss_mb"],
            "processes": r["processes"], "held_out": r["held_out"], "load": r["load"],
            "load_during": r["load_during"]}


ROWS = (("median step", "median_step_s", "{:.3f} s"), ("samples/s", "samples_per_s", "{:,.0f}"),
        ("wall (launch to exit)", "wall_s", "{:.1f} s"), ("first step, from process start", "first_step_s",
                                                          "{:.1f} s"),
        ("first step, from launch", "first_step_from_launch_s", "{:.1f} s"),
        ("memory of all processes (PSS peak)", "pss_mb", "{:,.0f} MB"), ("held-out accuracy after", "held_out",
                                                                           "{:.3f}"))


def table(runs: list[dict], steps: int, command: str) -> str:
    """Markdown: per row the median over runs of each side (and each seed's held-out), the ratio rlslurm / TRL."""
    sides = {s: [summary(r) for r in runs if r["side"] == s] for s in ("rlslurm", "trl")}
    lines = [f"`{command}`", "",
             f"{steps} steps, {len(sides['rlslurm'])} run(s) a side, interleaved; load at start "
             f"{min(r['load'] for r in runs):.2f}-{max(r['load'] for r in runs):.2f}, during "
             f"{min(r['load_during'] for r in runs):.2f}-{max(r['load_during'] for r in runs):.2f} "
             f"(2 cores); medians over runs", "",
             "| | rlslurm | TRL | rlslurm / TRL |", "|---|---|---|---|"]
    for label, key, fmt in ROWS:
        a = statistics.median(s[key] for s in sides["rlslurm"])
        b = statistics.median(s[key] for s in sides["trl"])
        extra = ""
        if key == "held_out":
            per = {side: " / ".join(f"{s['held_out']:.3f}" for s in sides[side]) for side in sides}
            lines.append(f"| held-out per run (seeds {' '.join(str(r['seed']) for r in runs if r['side'] == 'trl')})"
                         f" | {per['rlslurm']} | {per['trl']} | |")
        if key == "pss_mb":
            extra = f" ({statistics.median(s['processes'] for s in sides['rlslurm']):.0f} processes)"
        lines.append(f"| {label} | {fmt.format(a)}{extra} | {fmt.format(b)} | {a / b:.2f} |")
    return "\n".join(lines)


def write_results(path: Path, text: str) -> None:
    """Replace the block between the bench's markers in `path` (or add it at the end)."""
    doc = path.read_text()
    block = f"{MARK_START}\n{text}\n{MARK_END}"
    if MARK_START in doc and MARK_END in doc:
        head, rest = doc.split(MARK_START, 1)
        doc = head + block + rest.split(MARK_END, 1)[1]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(doc)


def compiled_as_installed() -> None:
    """rlslurm's modules compiled to bytecode, as `pip install` leaves them (and TRL's): from a checkout under
    PYTHONDONTWRITEBYTECODE=1 (this machine's environment) every process would compile them again at its start."""
    import compileall

    import rlslurm
    import rlslurm.diag
    import rlslurm.jobs

    for package in (rlslurm, rlslurm.diag, rlslurm.jobs):
        for folder in package.__path__:
            compileall.compile_dir(folder, quiet=2)  # where it cannot write (a read-only install), it is compiled


def make_export(root: Path) -> Path:
    subprocess.run([_rlslurm(), "submit", "examples/tiny-sft.yaml", "--backend", "local", "--run-root", str(root),
                    "--wait"], cwd=ROOT, check=True, capture_output=True)
    run = max(root.glob("tiny-sft-*"), key=lambda p: p.stat().st_mtime)
    return run / "export" / "hf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, help="an SFT export (<tiny-sft run>/export/hf)")
    ap.add_argument("--make-export", action="store_true", help="run examples/tiny-sft.yaml first for the export")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--pairs", type=int, default=1, help="A/B pairs per seed")
    ap.add_argument("--quiet-load", type=float, default=None, help="wait for the 1-min load to fall to this")
    ap.add_argument("--quiet-wait-s", type=float, default=900.0)
    ap.add_argument("--sides", nargs="+", default=["rlslurm", "trl"], choices=["rlslurm", "trl"])
    ap.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override of examples/tiny-grpo.yaml for the rlslurm side (repeatable)")
    ap.add_argument("--run-root", type=Path, default=ROOT / "runs" / "bench-vs-trl")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--results-md", type=Path, help="write the table into this file (between the bench's markers)")
    ap.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--inputs", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_child:
        trl_child(args)
        return 0
    args.run_root.mkdir(parents=True, exist_ok=True)
    compiled_as_installed()
    export = make_export(args.run_root / "sft") if args.make_export else args.export
    if export is None or not (export / "config.json").is_file():
        ap.error("--export must be an SFT export holding config.json (or pass --make-export)")
    export = export.resolve()
    runs = []
    for seed in args.seeds:
        inputs = job_inputs(args.steps, seed, tuple(args.rl_set))
        inputs_file = args.run_root / f"inputs-{seed}.json"
        inputs_file.write_text(json.dumps(inputs))
        for pair in range(args.pairs):
            order = args.sides if (pair + seed) % 2 == 0 else list(reversed(args.sides))
            for side in order:
                load = wait_quiet(args.quiet_load, args.quiet_wait_s)
                if side == "rlslurm":
                    r = run_rlslurm(export, args.steps, seed, inputs, args.run_root / "rlslurm", tuple(args.rl_set))
                else:
                    r = run_trl(export, args.steps, seed, inputs_file, args.run_root / f"trl-{seed}-{pair}.json")
                r["load"] = load
                runs.append(r)
                s = summary(r)
                print(f"{side:8} seed {seed}: median step {s['median_step_s']:.3f} s, {s['samples_per_s']:,.0f} "
                      f"samples/s, wall {s['wall_s']:.1f} s, first step {s['first_step_s']:.1f} s "
                      f"({s['first_step_from_launch_s']:.1f} s from launch), PSS {s['pss_mb']:,.0f} MB in "
                      f"{s['processes']} processes, held-out {s['held_out']:.3f}; load {load:.2f} -> "
                      f"{s['load_during']:.2f}", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(runs, indent=1))
    if set(args.sides) == {"rlslurm", "trl"}:
        command = "python bench/bench_vs_trl.py " + " ".join(a for a in sys.argv[1:] if a != "--results-md"
                                                             and a != str(args.results_md))
        text = table(runs, args.steps, command)
        print(text)
        if args.results_md:
            write_results(args.results_md, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
