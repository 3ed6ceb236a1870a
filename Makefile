# Two commands on a fresh machine (see README):
#   make demo   install everything, then run the main job on the embedded default
#   make test   install everything, then run the whole test suite (what .ci/run runs)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test
install:
	bash sbatch/install.sh $(VENV)

demo: install
	RLSLURM=$(VENV)/bin/rlslurm bash examples/demo.sh

# tests/cluster starts a real local Slurm (root, Debian packages); one that cannot start is an error.
test: install
	$(PY) -m pytest -ra -p no:cacheprovider tests
