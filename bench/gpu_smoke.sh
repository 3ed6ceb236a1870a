#!/usr/bin/env bash
# The GPU smoke test (issue 7), one GPU, meant to finish in under 8 minutes. NOT RUN ON A GPU YET (docs/gpu.md).
#   bash bench/gpu_smoke.sh [OUT_DIR]            # default OUT_DIR: runs/gpu-smoke
# 1. checks nvidia-smi; 2. installs the [gpu] extra (vllm, megatron-core) into a venv and times it;
# 3. runs examples/tiny-grpo-gpu.yaml: the tiny model served by vLLM, two GRPO steps with the Megatron
#    trainer, a verified weight sync after each (rlslurm submit --backend local --wait);
# 4. prints per sync VERIFY and GB/s, and the plan's predicted vs the measured trainer peak memory
#    (bench/gpu_smoke.py report; the summary also lands in OUT_DIR/summary.json). Exit 0 = PASS.
# Environment:
#   GPU_SMOKE_PYTHON=/path/python   use this interpreter as it is (it has the [gpu] extra): no venv, no install
#   GPU_SMOKE_VENV=.venv-gpu        the venv to make or reuse
#   GPU_SMOKE_WHEELS=DIR            install offline from a wheelhouse (pip --no-index --find-links DIR)
#   GPU_SMOKE_SYNC=auto|ipc|broadcast  auto = ipc: one GPU cannot hold the trainer's and the engine's NCCL
#                                   ranks ("Duplicate GPU detected"); broadcast is refused by the preflight
#   GPU_SMOKE_BUDGET_S=480          the whole script's time budget in seconds
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
out=${1:-runs/gpu-smoke}
budget=${GPU_SMOKE_BUDGET_S:-480}
mkdir -p "$out"
started=$SECONDS

left() { echo $((budget - (SECONDS - started))); }

# 1. a GPU
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_smoke: no nvidia-smi on PATH: this test needs an NVIDIA GPU and its driver" >&2
  exit 2
fi
nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader | tee "$out/gpus.txt"
gpus=$(wc -l <"$out/gpus.txt")

# 2. the [gpu] extra, timed
t0=$SECONDS
if [ -n "${GPU_SMOKE_PYTHON:-}" ]; then
  py=$GPU_SMOKE_PYTHON
  echo "gpu_smoke: using $py as it is (GPU_SMOKE_PYTHON): nothing installed"
else
  venv=${GPU_SMOKE_VENV:-.venv-gpu}
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  pip_args=(-q --disable-pip-version-check)
  if [ -n "${GPU_SMOKE_WHEELS:-}" ]; then
    pip_args+=(--no-index --find-links "$GPU_SMOKE_WHEELS")
  fi
  # pyproject pins torch==2.13.0 and vllm==0.32.0 (the vLLM built against that torch); from PyPI the
  # torch wheel is the CUDA build.
  "$venv/bin/python" -m pip install "${pip_args[@]}" -e ".[gpu]"
  py=$venv/bin/python
fi
install_s=$((SECONDS - t0))
echo "gpu_smoke: [gpu] extra ready in ${install_s} s"
"$py" - <<'EOF'
import torch, vllm, megatron.core
if not torch.cuda.is_available():
    raise SystemExit(f"gpu_smoke: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
print(f"gpu_smoke: torch {torch.__version__} CUDA {torch.version.cuda} NCCL {torch.cuda.nccl.version()}, "
      f"vllm {vllm.__version__}, megatron-core {megatron.core.__version__}, {torch.cuda.get_device_name(0)}")
EOF

# 3. the job
sync=${GPU_SMOKE_SYNC:-auto}
if [ "$sync" = auto ]; then
  sync=ipc
fi
if [ "$(left)" -lt 120 ]; then
  echo "gpu_smoke: only $(left) s of the ${budget} s budget left after the install; the job needs ~2-3 min" >&2
  exit 3
fi
echo "gpu_smoke: ${gpus} GPU(s); sync.method = ${sync}; $(left) s left"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
status=0
"$py" bench/gpu_smoke.py run examples/tiny-grpo-gpu.yaml --run-root "$out/runs" --set "sync.method=${sync}" \
  --timeout-s "$(( $(left) - 10 ))" --install-s "$install_s" --json "$out/summary.json" || status=$?

# 4. evidence beside the summary: the engine's and the trainer's logs
run_dir=$(ls -dt "$out"/runs/*/ 2>/dev/null | head -n 1 || true)
if [ -n "$run_dir" ]; then
  tail -n 40 "$run_dir"logs/engine-0.log >"$out/engine-0.tail.log" 2>/dev/null || true
  tail -n 80 "$run_dir"logs/submitit/*_0_log.err >"$out/trainer.tail.log" 2>/dev/null || true
fi
echo "gpu_smoke: $((SECONDS - started)) s in all (budget ${budget} s); exit ${status}"
exit "$status"
