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

# Fashion-MNIST's IDX files come from Debian's package (as root: CI; elsewhere it says how).
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: install data quickstart test test-gpu lint bench mutate docs
install: $(STAMP)

data:
	@test -f $(FMNIST) || apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1) \
		|| echo "Fashion-MNIST missing: run 'sudo apt-get install dataset-fashion-mnist' (its real-data tests are skipped outside CI)."

quickstart: $(STAMP) data
	$(VENV)/bin/lightning-fl fit --config recipes/quickstart.yaml

lint: $(STAMP) data
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	WANDB_MODE=offline $(PY) -m pytest -q -n auto --dist loadfile --durations=15

# The GPU test mode (tests/conftest.py): CUDA runs of the late paths, the vectorized =
# sequential equalities, the composition matrix and the recipes; report in
# benchmarks/results/gpu.md. It needs the CUDA torch you already have, not .venv's CPU
# wheel: GPU_PYTHON names that interpreter (with this package installed in it).
GPU_PYTHON ?= python3
test-gpu:
	WANDB_MODE=offline $(GPU_PYTHON) -m pytest -q --accelerator gpu -n 4 --dist loadfile --durations=15

# Mutation testing of one module (tests/mutate.py, issue 39): realistic bugs written into
# MODULE one at a time, TESTS run against each, the survivors printed.
#   make mutate MODULE=lightning_fl/systems/forgetting.py TESTS=tests/test_unlearning.py
mutate: $(STAMP)  # ARGS="--survivors result.json" reruns an earlier run's survivors; ARGS="--since main~3" tries only the lines changed since that revision
	$(PY) -m tests.mutate $(MODULE) $(TESTS) $(ARGS)

# The documentation site (mkdocs.yml, docs/): the README as its guide, the architecture
# page, the recipes and the API reference from the docstrings, built strictly into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
