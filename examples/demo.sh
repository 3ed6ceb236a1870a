#!/usr/bin/env bash
# The main job on the embedded default, on this machine (no GPU, no SLURM needed):
#   the plan of the lecture's cluster, then SFT of the tiny model, then GRPO from its export as it is.
#   bash examples/demo.sh [RUN_ROOT]        (`make demo` installs first, then runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-runs/demo}
rlslurm=${RLSLURM:-rlslurm}
"$rlslurm" plan examples/lecture-h20.yaml
"$rlslurm" submit examples/tiny-sft.yaml --backend local --run-root "$root" --wait
sft=$(ls -td "$root"/tiny-sft-* | head -n 1)
"$rlslurm" submit examples/tiny-grpo.yaml --backend local --run-root "$root" --wait \
  --set "train.init_from=$sft/export/hf"
rl=$(ls -td "$root"/tiny-grpo-* | head -n 1)
"$rlslurm" status "$rl"
"$rlslurm" report "$rl"     # report.png + report.html under $rl/report
grep -h '"held_out_accuracy"\|"heldout_accuracy"' "$sft/metrics.jsonl" "$rl/metrics.jsonl" | tail -n 3
