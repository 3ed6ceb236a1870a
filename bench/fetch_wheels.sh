#!/usr/bin/env bash
# The wheels the GPU check (bench/gpu_smoke.sh) carries to an offline GPU box, fetched HERE, where PyPI is
# reachable, into .whl/ (ignored by git). The box (/work/shared/notes/gpu-check-target.md, docs/gpu.md):
# Python 3.12, x86-64 manylinux, torch 2.11 and transformers already installed; what rlslurm needs beyond
# them travels as cp312 wheels, each pinned to the version this checkout's venv tests with.
#   bash bench/fetch_wheels.sh [WHEEL_DIR]          # default .whl
# Environment:
#   FETCH_PYTHON=.venv/bin/python   the interpreter whose installed versions are pinned (and that runs pip)
#   FETCH_PLATFORM=manylinux_2_28_x86_64, FETCH_PY=3.12   the box's platform and Python
# Last: rlslurm's own wheel, built from this checkout (no network: --no-build-isolation), so the box installs
# every package the same way (pip install --no-index --no-deps --target DIR WHEEL_DIR/*.whl).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
dest=${1:-.whl}
py=${FETCH_PYTHON:-.venv/bin/python}
platform=${FETCH_PLATFORM:-manylinux_2_28_x86_64}
pyver=${FETCH_PY:-3.12}
mkdir -p "$dest"

# What the box lacks (the note's list) and what those need in turn, installed there with --no-deps.
packages=(submitit cloudpickle fastapi starlette pydantic pydantic-core annotated-types typing-inspection
          anyio sniffio h11 uvicorn py-spy megatron-core hypothesis sortedcontainers pyseccomp)
pins=$("$py" - "${packages[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"fetch_wheels: {', '.join(missing)} not installed in {sys.executable}: nothing to pin them to")
EOF
)
# shellcheck disable=SC2086
"$py" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp --platform "$platform" --platform manylinux2014_x86_64 --platform linux_x86_64 \
  -d "$dest" $pins
"$py" -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation -w "$dest" .
ls -l "$dest"
du -sh "$dest"
