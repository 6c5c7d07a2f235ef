# Set-up and entry points. `make train` and `make test` work on a machine with only Python:
# they create .venv, install the CPU build of torch (override TORCH_SPEC / TORCH_INDEX for
# another build) and fsdpkit itself with its optional extras (plot, tensorboard, hf: the tests
# cover them; the core needs none of them), then run.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fsdpkit-installed
export OMP_NUM_THREADS ?= 1

.PHONY: install train test clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,plot,tensorboard,hf]"
	touch $(STAMP)

train: install
	$(VENV)/bin/fsdpkit train --nproc-per-node 2 --steps 500 --global-batch-size 16 --seq-len 128 --eval-every 100 --lr-schedule cosine --warmup-steps 20

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
