# Set-up and entry points. `make train` and `make test` work on a machine with only Python:
# they create .venv, install the CPU build of torch (override TORCH_SPEC / TORCH_INDEX for
# another build) and fsdpkit itself with its optional extras (plot, tensorboard, hf: the tests
# cover them; lint: ruff and mypy for `make lint`; the core needs none of them), then run.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fsdpkit-installed
export OMP_NUM_THREADS ?= 1

.PHONY: install train test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,lint,plot,tensorboard,hf]"
	touch $(STAMP)

train: install
	$(VENV)/bin/fsdpkit train --nproc-per-node 2 --steps 500 --global-batch-size 16 --seq-len 128 --eval-every 100 --lr-schedule cosine --warmup-steps 20

test: install
	$(PY) -m pytest -q tests

# ruff (lint rules and format check, settings in pyproject.toml), then mypy on fsdpkit/.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
