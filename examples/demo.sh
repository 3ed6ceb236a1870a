#!/usr/bin/env bash
# The main job on the embedded default, on this machine (no GPU, no SLURM needed):
#   the plan of the lecture's cluster, then SFT of the tiny model, then GRPO from its export as it is.
#   bash examples/demo.sh [RUN_ROOT]        (`make demo` installs first, then runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-runs/demo}
rlslurm=${RLSLURM:-rlslurm}
# The lecture's MoE (EP 8) is planned whole, then refused by the pre-flight (exit 3): rlslurm's trainers run
# dense models over TP x DP so far, and the plan says so rather than promise a run.
"$rlslurm" plan examples/lecture-h20.yaml || [ $? -eq 3 ]
"$rlslurm" submit examples/tiny-sft.yaml --backend local --run-root "$root" --wait
sft=$(ls -td "$root"/tiny-sft-* | head -n 1)
"$rlslurm" submit examples/tiny-grpo.yaml --backend local --run-root "$root" --wait \
  --set "train.init_from=$sft/export/hf"
rl=$(ls -td "$root"/tiny-grpo-* | head -n 1)
"$rlslurm" status "$rl"
"$rlslurm" report "$rl"     # report.png + report.html under $rl/report
# The result in one line: where SFT stopped, its held-out accuracy, RL's evaluations, the gain.
py=$(dirname "$(command -v "$rlslurm")")/python
[ -x "$py" ] || py=python3
"$py" - "$sft/metrics.jsonl" "$rl/metrics.jsonl" <<'PY'
import json, sys
sft = [json.loads(line) for line in open(sys.argv[1])]
rl = [json.loads(line) for line in open(sys.argv[2])]
ev = next(r for r in sft if r.get("kind") == "sft_eval")
dev = [r for r in sft if r.get("kind") == "sft_dev"]
evals = [(r["step"], r["held_out_accuracy"]) for r in rl if "held_out_accuracy" in r]
where = f"dev {dev[-1]['dev_accuracy']:.3f}" if dev else "no dev target"
print(f"SFT stopped at step {ev['step']} ({where}): held-out {ev['held_out_accuracy']:.3f}; GRPO held-out "
      + ", ".join(f"{a:.3f}@{s}" for s, a in evals)
      + f"; gain {evals[-1][1] - ev['held_out_accuracy']:+.3f} on the same {ev['held_out_total']} problems")
PY
