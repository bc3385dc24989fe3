# hspmd: `make demo` and `make test` work on a fresh machine; `make install` is what both need.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# xdist workers for `make test`; the integration tests stay serial on one of them (tests/conftest.py).
TEST_WORKERS ?= 2
STAMP  := $(VENV)/.installed

.PHONY: install test unit integration demo bench lint clean wheels torch-floor

install: $(STAMP)

# An importable torch on $(PYTHON) is kept (the venv sees system site-packages; where $(PYTHON) is itself
# a venv, whose packages a --system-site-packages venv would not see, a .pth file adds its site-packages);
# otherwise the pinned CPU build is installed first, so that `torch>=...` in setup.cfg is already satisfied.
$(STAMP): setup.cfg pyproject.toml
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
		echo "using the torch already importable from $(PYTHON)"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
		$(PYTHON) -c "import site, sys; sys.prefix != sys.base_prefix and print(*site.getsitepackages(), sep=chr(10))" \
			> "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hspmd-parent-venv.pth"; \
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

# The wheels scripts/gpu_check.sh installs offline (pip --no-index) where a GPU machine's python lacks them:
# run where PyPI is reachable, then bring ./wheels along. One set per Python version the machine may have.
WHEELS ?= wheels
WHEEL_PYTHONS ?= 3.10 3.11 3.12 3.13
CHECK_PACKAGES := pyyaml click rich safetensors tokenizers pulp highspy
wheels:
	@for v in $(WHEEL_PYTHONS); do \
		$(PYTHON) -m pip download --quiet --only-binary=:all: --python-version $$v --implementation cp \
			--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
			--dest $(WHEELS) $(CHECK_PACKAGES) || exit 1; \
	done
	@ls $(WHEELS) | wc -l | xargs echo "wheels in $(WHEELS):"

# The oldest torch setup.cfg accepts (torch>=$(TORCH_FLOOR)), proven: the unit tests and a short training run
# in a venv of its own holding that torch. Not part of `make test`. TORCH_INDEX: where its CPU build is
# (empty: PyPI, whose Linux wheel is the CUDA build, several GB with its libraries).
TORCH_FLOOR ?= 2.11.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
FLOOR_VENV ?= .venv-torch-floor
torch-floor:
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install --quiet "torch==$(TORCH_FLOOR)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(FLOOR_VENV)/bin/pip install --quiet -e ".[dev]"
	$(FLOOR_VENV)/bin/python -c "import torch; v = torch.__version__.split('+')[0]; \
		assert v == '$(TORCH_FLOOR)', f'torch {v} in $(FLOOR_VENV), expected $(TORCH_FLOOR)'"
	$(FLOOR_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) tests/unit
	$(FLOOR_VENV)/bin/hspmd train --plan configs/plans/cpu-hetero4-tiny.yaml --steps 3

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info .pytest_cache .hypothesis demo-out gpu-check-out
