# The two fresh-machine commands: `make demo` and `make test` (each sets itself up in .venv).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test demo lint

$(BIN)/moe-attrib: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q "torch>=2.10,<3"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(BIN)/moe-attrib

lint: setup
	$(BIN)/ruff check moe_attrib tests benchmarks
	$(BIN)/ruff format --check moe_attrib tests benchmarks

test: lint
	$(BIN)/python -m pytest -q

demo: setup
	$(BIN)/moe-attrib demo --out moe-attrib-demo --overwrite
