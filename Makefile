# `make quickstart` and `make test` set up what they need: a virtual environment in .venv
# with the CPU build of torch (torch==2.13.0 takes the local wheel) and this package.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,plots]"
	touch $(STAMP)

.PHONY: install quickstart test lint bench
install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/lightning-fl fit --config recipes/quickstart.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	WANDB_MODE=offline $(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
