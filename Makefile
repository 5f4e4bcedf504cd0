# The two fresh-machine commands: `make demo` and `make test` (each sets itself up in .venv).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test demo lint check-latest

# Tested versions from constraints.txt (pyproject.toml keeps ranges for users); `make check-latest` tries the newest.
$(BIN)/moe-attrib: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt torch
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $@

setup: $(BIN)/moe-attrib

lint: setup
	$(BIN)/ruff check moe_attrib tests benchmarks
	$(BIN)/ruff format --check moe_attrib tests benchmarks

test: lint
	$(BIN)/python -m pytest -q

check-latest:
	bash .ci/check-latest

demo: setup
	$(BIN)/moe-attrib demo --out moe-attrib-demo --overwrite
