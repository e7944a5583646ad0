# Two commands for a fresh machine (see README):
#   make demo   — set up .venv and run the main job
#   make test   — set up .venv and run the tests
#   make test-fast — the unit tier only (tests/unit: no test there starts a process)
#   make test-conformance — the whole verl conformance suite (hdp against verl's stock Megatron engine)
#   make verl-demo — a few GRPO steps through verl's main_ppo with model_engine=hdp (CPU)
#   make test-verl090 — the fast tier and the verl tests on verl 0.9.0, the oldest supported verl (own venv)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

VENV090 := .venv-verl090
BIN090 := $(VENV090)/bin

.PHONY: setup demo verl-demo test test-fast test-conformance test-verl090 suite clean

$(BIN)/hdp: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned, so pip takes the CPU wheel from local disk, never a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	# verl 0.9.1 without its [megatron] extra (that extra pins torch 2.11)
	$(BIN)/pip install -q -e '.[test,verl]'
	touch $(BIN)/hdp

setup: $(BIN)/hdp

# the same install with verl 0.9.0 (the oldest release hdp supports) instead of the [verl] extra's pin
$(BIN090)/hdp: pyproject.toml
	$(PY) -m venv $(VENV090)
	$(BIN090)/pip install -q --upgrade pip
	$(BIN090)/pip install -q torch==2.13.0
	$(BIN090)/pip install -q -e '.[test]' torch==2.13.0
	$(BIN090)/pip install -q verl==0.9.0 uvicorn fastapi 'TransferQueue>=0.1.10' cachetools mbridge torch==2.13.0
	touch $(BIN090)/hdp

demo: setup
	$(BIN)/hdp demo --out out/demo

verl-demo: setup
	$(BIN)/hdp demo --verl --out out/verl-demo

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	# the unit tier (tests/conftest.py marks it fast from the path): no second process, the tier to run while working
	$(BIN)/python -m pytest -q tests/unit

test-conformance: setup
	# every case, main_ppo's included (make test runs a representative slice): docs/verl.md, "The conformance suite"
	HDP_CONFORMANCE=all $(BIN)/python -m pytest -q tests/distributed/verl/test_verl_conformance.py tests/slow/verl/test_verl_conformance_all.py tests/unit/verl/test_verl_conformance_table.py

test-verl090: $(BIN090)/hdp
	$(BIN090)/python -m pytest -q -m fast
	$(BIN090)/python -m pytest -q tests/unit/verl/test_verl_config.py tests/distributed/verl/test_verl_config_dist.py tests/slow/verl/test_verl_config_slow.py tests/unit/verl/test_verl_patches.py tests/distributed/verl/test_verl_patches_dist.py tests/slow/verl/test_verl_main_ppo.py \
		"tests/slow/verl/test_verl_worker_path_slow.py::test_actor_rollout_ref_worker_drives_hdp[qwen3]"

suite: setup
	$(BIN)/hdp simulate --suite

clean:
	rm -rf $(VENV) $(VENV090) out
