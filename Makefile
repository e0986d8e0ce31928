# Set-up and entry points. `make train` runs the main job, `make test` the test suite; each
# creates the project-local virtual environment (.venv) on first use and is idempotent.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
FASHION_MNIST := /usr/share/datasets/fashion-mnist

# The oldest TensorFlow / Keras that pyproject.toml admits, for `make test-oldest` (.ci/run).
OLDEST_VENV := .venv-oldest
OLDEST_STAMP := $(OLDEST_VENV)/.installed-stamp
OLDEST_TF := tensorflow==2.16.2
OLDEST_KERAS := keras==3.6.0
# keras-hub 0.32 (the oldest dpcore's KerasHub rules support) needs Keras >= 3.15. Its
# tensorflow-text requirement (>= 2.20.1, tokenizers only) is left out so that the BERT smoke
# runs on TensorFlow 2.16; dpcore never tokenizes.
OLDEST_HUB := keras==3.15.1 keras-hub==0.32.0
OLDEST_HUB_DEPS := regex rich packaging sentencepiece tokenizers "kagglehub!=1.0.1" "kagglesdk==0.1.28"
OLDEST_CORE_TESTS := tests/test_readme.py tests/test_keras_fit.py tests/test_epsilon_cli.py \
	tests/test_keras_losses.py
OLDEST_HUB_TESTS := tests/test_keras_hub.py::test_bert_classifier_matches_reference \
	tests/test_keras_hub.py::test_bert_with_lora_stays_on_the_fast_path

.PHONY: train test lint data test-oldest

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

# A smoke subset of the suite (the README example, make_private fit on the MLP/CNN/BERT, the
# epsilon CLI) on the oldest supported TensorFlow and Keras, in its own cached venv.
$(OLDEST_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q -e . '$(OLDEST_TF)' '$(OLDEST_KERAS)' \
		pytest hypothesis scikit-learn matplotlib
	$(OLDEST_VENV)/bin/python -m pip install -q $(OLDEST_HUB_DEPS)
	touch $(OLDEST_STAMP)

test-oldest: $(OLDEST_STAMP) data
	$(OLDEST_VENV)/bin/python -m pip install -q '$(OLDEST_KERAS)'
	$(OLDEST_VENV)/bin/python -c "import tensorflow as tf, keras; print('oldest:', tf.__version__, keras.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(OLDEST_CORE_TESTS)
	$(OLDEST_VENV)/bin/python -m pip install -q --no-deps $(OLDEST_HUB)
	$(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(OLDEST_HUB_TESTS)
