# Set-up and entry points. `make train` and `make test` work on a machine with only Python:
# they create .venv, install torch (TORCH_SPEC, from pip's configured index: its default build
# for this platform, which on Linux is the CUDA one; TORCH_INDEX=https://download.pytorch.org/whl/cpu
# picks the CPU wheels) and fsdpkit itself with its optional extras (plot, tensorboard, hf, data, wandb,
# mlflow, deepspeed, megatron, cloud, cloud-test: the tests cover them; lint: ruff, mypy and vulture for `make lint`; the core needs none of them), then run.
# pip's own output shows what is being downloaded and installed.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fsdpkit-installed
# `make test-compat`: a second environment with the oldest torch fsdpkit supports (pyproject's floor).
COMPAT_VENV ?= .venv-compat
COMPAT_TORCH_SPEC ?= torch==2.11.0
COMPAT_STAMP := $(COMPAT_VENV)/.fsdpkit-installed
export OMP_NUM_THREADS ?= 1

.PHONY: install train test test-compat lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@echo "== $(VENV): a virtual environment for $(PYTHON)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== $(TORCH_SPEC)$(if $(TORCH_INDEX), from $(TORCH_INDEX)) (the largest download)"
	$(PY) -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	@echo "== fsdpkit, editable, with the extras test, lint, plot, tensorboard, hf, data, wandb, mlflow, deepspeed, megatron, cloud, cloud-test"
	$(PY) -m pip install -e ".[test,lint,plot,tensorboard,hf,data,wandb,mlflow,deepspeed,megatron,cloud,cloud-test]"
	touch $(STAMP)
	@echo "== installed: $(VENV)/bin/fsdpkit"

train: install
	$(VENV)/bin/fsdpkit train --nproc-per-node 2 --steps 500 --global-batch-size 16 --seq-len 128 --eval-every 100 --lr-schedule cosine --warmup-steps 20

# Two pytest workers (pytest-xdist), each taking whole files, so a module's shared launches stay
# in one process: on 2 cores the launches' waits (rendezvous, timeouts) overlap the other's work.
# tests/compat is the compatibility suite, run by test-compat under the oldest torch.
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --ignore=tests/compat tests

# The compatibility suite (the commands as a user runs them first, the launcher, the torch window)
# under COMPAT_TORCH_SPEC, in its own environment: fsdpkit with its test extra only.
test-compat: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -m pytest -q tests/compat tests/dist

$(COMPAT_STAMP): pyproject.toml Makefile
	@echo "== $(COMPAT_VENV): $(COMPAT_TORCH_SPEC)$(if $(TORCH_INDEX), from $(TORCH_INDEX)), the oldest torch fsdpkit supports"
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(COMPAT_TORCH_SPEC)"
	$(COMPAT_VENV)/bin/python -m pip install -e ".[test]"
	touch $(COMPAT_STAMP)

# ruff (lint rules and format check, settings in pyproject.toml), mypy on fsdpkit/, then vulture
# for dead code (vulture_whitelist.py: the names only a caller's signature uses).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/vulture --min-confidence 80 fsdpkit cli vulture_whitelist.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build *.egg-info
