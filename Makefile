# Two commands for a fresh machine (see README):
#   make demo   — set up .venv and run the main job
#   make test   — set up .venv and run the tests
#   make test-fast — the fast tier only (no multi-process tests)
#   make test-conformance — the whole verl conformance suite (hdp against verl's stock Megatron engine)
#   make verl-demo — a few GRPO steps through verl's main_ppo with model_engine=hdp (CPU)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo verl-demo test test-fast test-conformance suite clean

$(BIN)/hdp: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned, so pip takes the CPU wheel from local disk, never a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	# verl 0.9.1 without its [megatron] extra (that extra pins torch 2.11)
	$(BIN)/pip install -q -e '.[test,verl]'
	touch $(BIN)/hdp

setup: $(BIN)/hdp

demo: setup
	$(BIN)/hdp demo --out out/demo

verl-demo: setup
	$(BIN)/hdp demo --verl --out out/verl-demo

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	# the fast tier (tests/conftest.py): no second process, the tier to run while working
	$(BIN)/python -m pytest -q -m fast

test-conformance: setup
	# every case, main_ppo's included (make test runs a representative slice): docs/verl.md, "The conformance suite"
	HDP_CONFORMANCE=all $(BIN)/python -m pytest -q tests/test_verl_conformance.py tests/test_verl_conformance_table.py

suite: setup
	$(BIN)/hdp simulate --suite

clean:
	rm -rf $(VENV) out
