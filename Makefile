# Set-up and entry points. `make train` runs the main job, `make test` the test suite; each
# creates the project-local virtual environment (.venv) on first use and is idempotent.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
FASHION_MNIST := /usr/share/datasets/fashion-mnist

.PHONY: train test lint data

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test,experiments]'
	touch $(STAMP)

# The main job; its last line names the run's results.json (under runs/).
train: $(STAMP)
	$(VENV)/bin/dpcore-train

# Real Fashion-MNIST (Debian package dataset-fashion-mnist) for the tests that read it and for
# experiments/train.py --dataset=fashion_mnist. Installed when possible (root with apt-get);
# the tests that need it say so when it is absent.
data:
	@if [ ! -d $(FASHION_MNIST) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get install -y -q dataset-fashion-mnist || \
		 (apt-get update -q && apt-get install -y -q dataset-fashion-mnist)) >/dev/null \
		|| echo "warning: could not install dataset-fashion-mnist"; \
	fi

# Two pytest workers (pytest-xdist): most of the suite's time is TensorFlow tracing, which runs on
# one core per process; the 20 slowest tests are listed at the end.
test: $(STAMP) data
	$(VENV)/bin/python -m ruff check dpcore dpcore_accounting experiments tests
	$(VENV)/bin/python -m mypy
	$(VENV)/bin/python -m pytest -q -n 2 --durations=20

lint: $(STAMP)
	$(VENV)/bin/python -m ruff check dpcore dpcore_accounting experiments tests
	$(VENV)/bin/python -m ruff format --check dpcore dpcore_accounting experiments tests
	$(VENV)/bin/python -m mypy
