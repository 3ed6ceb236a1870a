#!/usr/bin/env bash
# The GPU check for a small offline GPU box (docs/gpu.md; the box: /work/shared/notes/gpu-check-target.md):
# one GPU, its own python3 with torch and transformers, no network, ~10 minutes. NOT RUN ON A GPU YET.
#   bash bench/fetch_wheels.sh                 # here, with network: the carried wheels into .whl/ (ignored)
#   bash bench/gpu_smoke.sh [OUT_DIR]          # there: default OUT_DIR runs/gpu-check
#   bash bench/gpu_smoke.sh --cpu [OUT_DIR]    # anywhere: every step but the CUDA ones (CI: tests/integration/
#                                              # test_gpu_check_dry_run.py runs it with a wheel of this repo)
# 1. nvidia-smi (skipped with --cpu);
# 2. installs the carried wheels, rlslurm's own among them: pip install --no-index --no-deps --target
#    OUT_DIR/site WHEELS/*.whl, then everything runs with PYTHONPATH=OUT_DIR/site from OUT_DIR (the
#    installed rlslurm, not the checkout's tree: no bare `jobs`/`diag`, as tests/installed.py checks CI's);
# 3. the GPU-marked tests (pytest -m gpu; with --cpu they skip and their collection is what runs);
# 4. examples/tiny-grpo-gpu.yaml: a 2-step RL job, the Megatron trainer and the transformers engine colocated
#    on cuda, weights synced over CUDA IPC (with --cpu: hardware.profile cpu, ipc over shared memory) through
#    bench/gpu_smoke.py run, which samples nvidia-smi for every process's GPU memory while it runs;
# 5. OUT_DIR/gpu_check.json: peak memory per role against the plan's prediction, the step split, sync GB/s,
#    the engine-vs-trainer logprob gap, the tests' outcome, each stage's seconds. Exit 0 = PASS.
# Environment:
#   GPU_CHECK_PYTHON=python3     the box's interpreter (torch, transformers, pytest already there)
#   GPU_CHECK_WHEELS=.whl        the carried wheels
#   GPU_CHECK_BUDGET_S=600       the whole script's time budget in seconds
#   GPU_CHECK_SET="k=v k=v"      extra --set overrides of the job (CI shrinks the model on its CPUs)
#   GPU_CHECK_TESTS="tests/unit tests/integration"   where pytest -m gpu looks (tests/vllm needs vLLM, not carried)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cpu=0
if [ "${1:-}" = --cpu ]; then
  cpu=1
  shift
fi
out=${1:-runs/gpu-check}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${GPU_CHECK_PYTHON:-python3}
wheels=${GPU_CHECK_WHEELS:-$here/.whl}
budget=${GPU_CHECK_BUDGET_S:-600}
started=$SECONDS
left() { echo $((budget - (SECONDS - started))); }
stage() { echo "gpu_check: $* ($((SECONDS - started)) s, $(left) s left)"; }

# 1. a GPU
if [ "$cpu" = 1 ]; then
  stage "--cpu: no GPU wanted; the CUDA steps run on the CPU"
elif ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: no nvidia-smi on PATH: this check needs an NVIDIA GPU (or --cpu for the dry run)" >&2
  exit 2
else
  nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader | tee "$out/gpus.txt"
fi

# 2. the carried wheels, offline
t0=$SECONDS
shopt -s nullglob
carried=("$wheels"/*.whl)
if [ ${#carried[@]} -eq 0 ]; then
  echo "gpu_check: no wheels in $wheels: run bash bench/fetch_wheels.sh where PyPI is reachable, and carry .whl/" >&2
  exit 2
fi
rm -rf "$out/site"
"$py" -m pip install --disable-pip-version-check -q --no-index --no-deps --target "$out/site" "${carried[@]}"
export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
install_s=$((SECONDS - t0))
cd "$out"  # from here on the installed rlslurm is the one that imports
"$py" - "$cpu" <<'EOF' | tee "$out/versions.txt"
import importlib.util, sys, torch, transformers, megatron.core, rlslurm
# As tests/installed.py checks the CI's install: the wheel's rlslurm, both entrances import, and no bare
# `jobs` or `diag` (the checkout's folders, which install as rlslurm.jobs and rlslurm.diag) is on the path.
import rlslurm.jobs.sft, rlslurm.jobs.rl, rlslurm.diag.watchdog
where = rlslurm.__file__
if "/site/" not in where:
    sys.exit(f"gpu_check: rlslurm imports from {where}, not from the installed wheels")
bare = [name for name in ("jobs", "diag") if importlib.util.find_spec(name) is not None]
if bare:
    sys.exit(f"gpu_check: {', '.join(bare)} import by a bare name: the checkout is on the path, not only the wheel")
if sys.argv[1] == "0" and not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (--cpu)"
print(f"gpu_check: python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, megatron-core {megatron.core.__version__}, rlslurm from {where}; {gpu}")
EOF
stage "${#carried[@]} wheels installed in ${install_s} s"

# 3. the GPU-marked tests
t0=$SECONDS
tests_rc=0
# shellcheck disable=SC2086
timeout "$(( $(left) / 2 ))" "$py" -m pytest -q -m gpu -p no:cacheprovider --rootdir "$here" \
  -c "$here/pyproject.toml" --junitxml "$out/gpu-tests.xml" ${GPU_CHECK_TESTS:-$here/tests/unit $here/tests/integration} \
  >"$out/gpu-tests.log" 2>&1 || tests_rc=$?
tests_s=$((SECONDS - t0))
tail -n 3 "$out/gpu-tests.log"
# pytest exit 5: nothing selected; with --cpu every gpu test skips, which is the point
stage "gpu tests: exit ${tests_rc} in ${tests_s} s"

# 4. the 2-step RL job
if [ "$(left)" -lt 90 ]; then
  echo "gpu_check: only $(left) s left for the RL job (it needs ~1-2 min)" >&2
  exit 3
fi
sets=(--set sync.method=ipc --set rollout.engine=hf)
if [ "$cpu" = 1 ]; then
  # The local backend hands every trainer rank and engine a GPU of this machine and refuses a GPU profile
  # where there is none: the dry run plans the same job for the CPU.
  sets+=(--set hardware.profile=cpu)
fi
for kv in ${GPU_CHECK_SET:-}; do
  sets+=(--set "$kv")
done
job_rc=0
"$py" "$here/bench/gpu_smoke.py" run "$here/examples/tiny-grpo-gpu.yaml" --run-root "$out/runs" "${sets[@]}" \
  --timeout-s "$(( $(left) - 15 ))" --install-s "$install_s" --json "$out/summary.json" \
  --check-json "$out/gpu_check.json" --tests-xml "$out/gpu-tests.xml" --tests-rc "$tests_rc" \
  --tests-s "$tests_s" $([ "$cpu" = 1 ] && echo --cpu) || job_rc=$?

# evidence beside the JSON: the engine's and the trainer's logs
run_dir=$(ls -dt "$out"/runs/*/ 2>/dev/null | head -n 1 || true)
if [ -n "$run_dir" ]; then
  tail -n 40 "$run_dir"logs/engine-0.log >"$out/engine-0.tail.log" 2>/dev/null || true
  tail -n 80 "$run_dir"logs/submitit/*_0_log.err >"$out/trainer.tail.log" 2>/dev/null || true
fi
stage "done: job exit ${job_rc}, gpu tests exit ${tests_rc}; figures in $out/gpu_check.json"
if [ "$job_rc" != 0 ]; then exit "$job_rc"; fi
if [ "$tests_rc" != 0 ] && [ "$tests_rc" != 5 ]; then exit 1; fi
exit 0
