# hspmd: `make demo` and `make test` work on a fresh machine; `make install` is what both need.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# xdist workers for `make test`; the integration tests stay serial on one of them (tests/conftest.py).
TEST_WORKERS ?= 2
STAMP  := $(VENV)/.installed

.PHONY: install test unit integration demo bench lint clean

install: $(STAMP)

# An importable torch on $(PYTHON) is kept (the venv sees system site-packages); otherwise the
# pinned CPU build is installed first, so that `torch>=...` in setup.cfg is already satisfied.
$(STAMP): setup.cfg pyproject.toml
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
		echo "using the torch already importable from $(PYTHON)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
		$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)"; \
	fi
	$(BIN)/pip install --quiet -e ".[dev]"
	@# An editable install leaves our modules uncompiled, and where PYTHONDONTWRITEBYTECODE is set every
	@# start of a verb would compile them again (measured with scripts/bench_startup.py: validate at 2.2x
	@# the bare imports without the compiled files, 1.6x with them). A stale file is recompiled by Python as usual.
	$(BIN)/python -m compileall -q hetu_cli planner runtime >/dev/null
	@touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) tests

unit: install
	$(BIN)/python -m pytest -q tests/unit

integration: install
	$(BIN)/python -m pytest -q tests/integration

demo: install
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh

bench: install
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/bench_all.sh

lint: install
	$(BIN)/ruff check hetu_cli planner runtime scripts tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis demo-out
