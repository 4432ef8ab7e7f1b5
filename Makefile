# Two commands on a fresh machine: `make demo` and `make test`. Both create (or reuse) .venv,
# install the pinned CPU torch first (a looser request would pull a multi-GB CUDA build), then
# this project, then run.
PYTHON ?= python3
VENV ?= .venv
NPROC ?= 8
BIN := $(VENV)/bin
STAMP := $(VENV)/.qn_hf-installed

.PHONY: demo test test-unit test-all bench results install clean zoo-table zoo-sweep composition-table gpu-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(NPROC) scripts/demo.py --dp 2 --tp 2 --pp 2

# The CI-sized suite (about 21 minutes on 2 cores in a fresh clone, as the README says); test-all adds the
# tests marked long (471 of them, the zoo's full sweep included: about 11 minutes more).
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not long"

# The unit tier: every test that starts no process (schedules, shards, plans, the planner, the
# package's structure, the composition table), about a minute.
test-unit: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "unit and not long"

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

# Print the README's composition table from qn_hf/config/composition.py (test_composition checks they agree).
composition-table: $(STAMP)
	$(BIN)/python -c "from qn_hf.config.composition import markdown; print(markdown(), end='')"

# The zoo's full sweep: every type at the sp, cp2, ep2, tp2ep2 and pp2v2 columns (make test runs
# them for a few types only; test-all runs them too).
zoo-sweep: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m long tests/test_zoo.py

# Rerun the model zoo and rewrite tests/zoo_expected.json and the README's zoo table from the results.
zoo-table: $(STAMP)
	QN_HF_ZOO_UPDATE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/test_zoo.py

# The README's results table: ViT/GPT-2/Llama at (2,2,2) on 8 processes beside 1-process baselines.
results: $(STAMP)
	$(BIN)/python scripts/results.py

# On a GPU machine: parity at every mesh that fits its GPUs (NCCL), host syncs per step, and a bf16
# throughput benchmark against the plain model, as one table. Without GPUs: the same on small gloo worlds.
gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py

bench: $(STAMP)
	$(BIN)/python benchmarks/tp_vs_dtensor.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/data_parallel.py
	$(BIN)/python benchmarks/data_parallel.py --mesh 2,2,2
	$(BIN)/python benchmarks/convert.py

clean:
	rm -rf $(VENV) .pytest_cache
