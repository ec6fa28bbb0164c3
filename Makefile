# Two entry points (see README): `make demo` runs the P/D demo, `make test` runs
# lint, type checks and the whole test suite. Both create .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint typecheck pytest bench clean

$(BIN)/.kvbridge-installed: pyproject.toml scripts/setup.sh
	PY=$(PY) VENV=$(VENV) bash scripts/setup.sh
	touch $@

setup: $(BIN)/.kvbridge-installed

demo: setup
	$(BIN)/kvbridge demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy kvbridge

pytest: setup
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests

test: lint pytest

bench: setup
	$(BIN)/kvbridge bench all --out bench-out

clean:
	rm -rf $(VENV) bench-out .pytest_cache .mypy_cache .ruff_cache
