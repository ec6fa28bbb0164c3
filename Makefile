# Two entry points (see README): `make demo` runs the P/D demo, `make test` runs
# lint, type checks and the whole test suite. Both create .venv on first use;
# `make test` also installs vLLM's CPU build into it (once) for tests/integrations/vllm,
# and makes SGLang's CPU venv (.venv-sglang, once) for tests/integrations/sglang.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

SGLANG_VENV ?= .venv-sglang

.PHONY: setup setup-vllm setup-sglang test-hosts demo test test-full lint pytest pytest-full bench bench-peers clean

$(BIN)/.kvbridge-installed: pyproject.toml scripts/setup.sh
	PY=$(PY) VENV=$(VENV) bash scripts/setup.sh
	touch $@

setup: $(BIN)/.kvbridge-installed

# After kvbridge's own install, which puts torch in first; rerun when that reruns.
$(BIN)/.vllm-installed: $(BIN)/.kvbridge-installed scripts/setup_vllm.sh
	VENV=$(VENV) bash scripts/setup_vllm.sh
	touch $@

setup-vllm: $(BIN)/.vllm-installed

# SGLang 0.5.23 on CPU in a venv of its own (its pins differ from vLLM's), kvbridge in it.
$(SGLANG_VENV)/.kvbridge-sglang-installed: scripts/setup_sglang.sh scripts/sglang_requirements.txt pyproject.toml
	KVBRIDGE_SGLANG_VENV=$(abspath $(SGLANG_VENV)) bash scripts/setup_sglang.sh
	touch $@

setup-sglang: $(SGLANG_VENV)/.kvbridge-sglang-installed

demo: setup
	$(BIN)/kvbridge demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy kvbridge

test-hosts:
	bash scripts/test_hosts.sh

# KVBRIDGE_REQUIRE_VLLM=1 / KVBRIDGE_REQUIRE_SGLANG=1: the vLLM / SGLang tests fail, not
# skip, if vllm does not import / the SGLang venv is missing.
# The suite runs as two pytest processes side by side (scripts/pytest_pair.sh): the tests
# that start vLLM servers beside the rest. `make test` leaves out the sweeps marked `full` (each
# repeats, over more sizes or shapes, a behaviour one of its tests checks); `make
# test-full` runs them too. Each half ends with its time by package (tests/conftest.py)
# and its slowest tests.
PYTEST := KVBRIDGE_REQUIRE_VLLM=1 KVBRIDGE_REQUIRE_SGLANG=1 TRITON_INTERPRET=1 bash scripts/pytest_pair.sh $(BIN)/python \
	-q --durations=25
pytest: setup setup-vllm setup-sglang test-hosts
	$(PYTEST) -m "not full"

pytest-full: setup setup-vllm setup-sglang test-hosts
	$(PYTEST)

# Lint (mypy: about a minute on one core) runs beside the suite once everything is
# installed: a minute more of a busy machine, against a minute of CI's wall time.
# Either failing fails `make test` (once one fails, one already running runs to its end).
# The two venvs' installs (mostly downloads) run side by side too.
test: setup
	$(MAKE) --no-print-directory -j2 setup-vllm setup-sglang
	$(MAKE) --no-print-directory -j2 lint pytest

test-full: setup
	$(MAKE) --no-print-directory -j2 setup-vllm setup-sglang
	$(MAKE) --no-print-directory -j2 lint pytest-full

# Peers for the side-by-side transfer benchmark (optional: a peer that cannot be
# installed is reported as "unavailable: <reason>"). --no-deps keeps torch as is.
bench-peers: setup
	-$(BIN)/python -m pip install -q --no-deps -r kvbridge/bench/peers/requirements.txt
	-[ "$$(id -u)" = 0 ] && apt-get install -y -q libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null

bench: bench-peers
	$(BIN)/kvbridge bench all --out bench-out

clean:
	rm -rf $(VENV) bench-out .pytest_cache .mypy_cache .ruff_cache
