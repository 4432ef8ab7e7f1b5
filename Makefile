# Two commands on a fresh machine: `make demo` and `make test`. Both create (or reuse) .venv,
# install the pinned CPU torch first (a looser request would pull a multi-GB CUDA build), then
# this project, then run.
PYTHON ?= python3
VENV ?= .venv
NPROC ?= 8
BIN := $(VENV)/bin
STAMP := $(VENV)/.qn_hf-installed

.PHONY: demo test test-unit test-long-slice durations test-all test-compat test-newest bench results install clean zoo-table zoo-sweep heads-table heads-sweep composition-table gpu-check lint golden

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# NPROC processes, one rank each (8: dp=2 x tp=2 x pp=2); any other count, e.g. `make demo NPROC=4`,
# trains at the mesh scripts/demo.py chooses for it and names on its first line.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node $(NPROC) scripts/demo.py

# The CI-sized suite: the unit tier and every test that starts processes and must be covered (a case a composes
# mark needs, a user-facing script's, one marked core: tests/conftest.py), checked for that cover (--cover) and held
# to TEST_BUDGET_S seconds of the times recorded in tests/durations.json (tests/suite_time.py: a selection over
# budget stops before running, naming its slowest tests). The times are a quiet fresh clone's (2026-12-02: 830
# tests in 14 min 35 s, 15 min 38 s with the install); 18 minutes of them leave the install inside 20.
TEST_BUDGET_S ?= 1080
PYTEST_ARGS ?=
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not long" --cover --budget $(TEST_BUDGET_S) --durations=30 $(PYTEST_ARGS)

# The unit tier: every test that starts no process (schedules, shards, plans, the planner, the
# package's structure, the composition table) and asserts no wall-clock time, about a minute.
test-unit: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "unit and not long"

# The long tier in slices of about SLICE_BUDGET_S seconds each (as many as that takes, K: the run names
# it); `make test-long-slice SLICE=N` runs slice N mod K (.ci/run: N the commit count), a test not started
# SLICE_DEADLINE_S after the start skipped and named. `make durations` reruns everything, rewriting
# tests/durations.json.
SLICE_BUDGET_S ?= 480
SLICE_DEADLINE_S ?= 960
SLICE ?= 0
test-long-slice: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m long --long-slice $(SLICE) --slice-budget $(SLICE_BUDGET_S) \
		--slice-deadline $(SLICE_DEADLINE_S) --durations=10

durations: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --record-durations

# ruff, with the rules pyproject.toml selects, over the package, the tests, the scripts and the benchmarks.
lint: $(STAMP)
	$(BIN)/python -m pip install --quiet "ruff>=0.6"
	$(BIN)/python -m ruff check qn_hf tests scripts benchmarks

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

# The two ends of what qn_hf supports, each in a venv of its own with the test extra and the equivalence
# tests of every dimension (COMPAT_TESTS; tests/releases.py says how the suite treats a release the test extra
# does not pin):
# - make test-compat: the oldest releases (requirements/oldest.txt), torch 2.11 and transformers 5.17.
#   tests/test_compat.py also forces qn_hf/compat.py's torch fallbacks on .venv's torch 2.13.
# - make test-newest: the newest (requirements/newest.txt), torch 2.15 and transformers 5.25.
# Neither torch has a CPU-only wheel on the package index: each venv takes the default wheel, a CUDA build
# that runs on the CPU: about 3 GB downloaded and 5.3 GB in the venv (torch 2.15.0's install from PyPI: 67 s here;
# pip's cache did not keep it on this machine, so each new venv downloads again). Measured on 2 cores, the venv
# created anew (2026-12-05): test-compat 9 min 1 s (install 2 min 15 s; unit tier 3 min 8 s; the 71 equivalence
# tests 3 min 21 s), test-newest about 8 min 10 s (install 2 min 5 s; 2 min 55 s; 3 min 6 s).
release = $(shell sed -n 's/^$(1)==//p' requirements/$(2).txt)
COMPAT_TORCH ?= $(call release,torch,oldest)
COMPAT_TRANSFORMERS ?= $(call release,transformers,oldest)
NEWEST_TORCH ?= $(call release,torch,newest)
NEWEST_TRANSFORMERS ?= $(call release,transformers,newest)
COMPAT_VENV ?= .venv-compat
NEWEST_VENV ?= .venv-newest
# a venv's stamp names its releases, so that another release given on the command line installs anew
COMPAT_STAMP = $(COMPAT_VENV)/.qn_hf-installed-$(COMPAT_TORCH)-$(COMPAT_TRANSFORMERS)
NEWEST_STAMP = $(NEWEST_VENV)/.qn_hf-installed-$(NEWEST_TORCH)-$(NEWEST_TRANSFORMERS)
COMPAT_TESTS := tests/test_compat.py \
	'tests/test_parity.py::test_tensor_and_data_parallel[gpt2-2-2-2-True]' \
	'tests/test_parity.py::test_tensor_and_data_parallel[vit-2-2-1-False]' \
	'tests/test_parity.py::test_tensor_and_data_parallel[qwen2-1-2-1-False]' \
	'tests/test_parity.py::test_tensor_and_data_parallel[mistral-1-2-1-False]' \
	'tests/test_parity.py::test_pipeline[llama-2-2-2-1f1b-4-None]' \
	'tests/test_parity.py::test_pipeline[gpt2-1-2-2-gpipe-3-None]' \
	'tests/test_parity.py::test_data_parallel_3d[llama-2-2-2-1f1b-2]' \
	'tests/test_parity.py::test_schedules[llama_deep-2-1-2-interleaved_1f1b-2-3-None-None]' \
	'tests/test_parity.py::test_schedules[gpt2_deep-2-1-2-zb_h1-1-3-None-5]' \
	'tests/test_data_parallel.py::test_no_sync_accumulates_over_steps[llama-2-2-1-1f1b-1]' \
	'tests/test_optimizer.py::test_zero_equals_the_unsharded_optimizer[llama-2-2-1-SGD-1f1b]' \
	'tests/test_optimizer.py::test_zero_checkpoint_resumes_at_other_meshes[gpt2-None]' \
	'tests/test_dcp.py::test_fsdp2_checkpoint_resumes_in_qn_hf_at_any_mesh[llama]' \
	'tests/test_dcp.py::test_qn_hf_dcp_loads_into_fsdp2[gpt2-mesh0-False]' \
	'tests/test_recompute.py::test_recompute_is_bit_for_bit[llama-1-2-2-selective-False-1]' \
	'tests/test_sequence_parallel.py::test_sequence_parallel_equals_plain_model[qwen3-2-2-1-1-True]' \
	'tests/test_sequence_parallel.py::test_whole_regions_equal_plain_model[deepseek_v3-tp2-pp2]' \
	'tests/test_sequence_parallel.py::test_whole_regions_equal_plain_model[minicpm3-dp2-tp2]' \
	'tests/test_sequence_parallel.py::test_whole_regions_equal_plain_model[gemma4_text-dp2-tp2]' \
	'tests/test_sequence_parallel.py::test_whole_regions_equal_plain_model[llama4_text-tp2]' \
	'tests/test_sequence_parallel.py::test_whole_regions_equal_plain_model[hy_v4-tp2]' \
	'tests/test_context_parallel.py::test_context_parallel_equals_plain_model[qwen3-1-2-1-2-1-False-True]' \
	tests/test_context_parallel.py::test_context_parallel_with_attention_sinks_equals_plain_model \
	'tests/test_context_parallel.py::test_context_parallel_with_schedules_equals_plain_model[zb_h1-1-2]' \
	'tests/test_context_parallel.py::test_checkpoint_moves_between_cp_and_other_meshes[True]' \
	'tests/test_expert_parallel.py::test_expert_parallel_equals_plain_model[mixtral-2-2-1-4-1]' \
	'tests/test_expert_parallel.py::test_expert_parallel_equals_plain_model[deepseek_v3-2-1-2-2-2]' \
	'tests/test_expert_parallel.py::test_expert_parallel_equals_plain_model[olmoe-2-1-1-2-1]' \
	'tests/test_expert_parallel.py::test_expert_parallel_equals_plain_model[qwen2_moe-2-1-1-2-1]' \
	'tests/test_expert_parallel.py::test_expert_parallel_equals_plain_model[qwen3_moe-1-2-1-2-1]' \
	'tests/test_expert_parallel.py::test_router_aux_loss_equals_plain_model[mixtral-2-1-2-True]' \
	'tests/test_expert_parallel.py::test_expert_parallel_with_recomputation[deepseek_v3-2-2-1-4-selective]' \
	'tests/test_expert_parallel.py::test_expert_parallel_with_zero_equals_plain_model[qwen3_moe-2-2-1-2-None-all_to_all]' \
	'tests/test_expert_parallel.py::test_expert_parallel_with_context_parallel_equals_plain_model[mixtral-1-2-2-2-False]' \
	'tests/test_expert_parallel.py::test_expert_parallel_with_sequence_parallelism_equals_plain_model[qwen2_moe-2-2-1-2-False]' \
	tests/test_expert_parallel.py::test_expert_parallel_checkpoints_move_between_ep_degrees \
	'tests/test_expert_parallel.py::test_meta_model_reads_per_expert_hf_layout[mixtral-2-1-2]' \
	'tests/test_expert_parallel.py::test_stacked_experts_under_expert_parallelism_equal_plain_model[1-2-all_to_all-2-12]' \
	'tests/test_expert_parallel.py::test_gemma4_with_its_moe_block[ep2]' \
	'tests/test_sharded_data_parallel.py::test_sharded_data_parallel_equals_plain_model[llama-dp2-shard2-tp2-sp]' \
	'tests/test_sharded_data_parallel.py::test_sharded_data_parallel_with_pipeline_equals_plain_model[llama-dp2-shard2-tp1-pp2-1f1b-step]' \
	'tests/test_sharded_data_parallel.py::test_sharded_data_parallel_with_expert_parallelism_equals_plain_model[dp4-shard2-ep2]' \
	tests/test_sharded_data_parallel.py::test_sharded_data_parallel_with_lora_equals_peft \
	'tests/test_triples.py::test_dp_tp_ep_cp_equals_plain_model[None]' \
	'tests/test_triples.py::test_tp_sp_pp_interleaved_cp_equals_plain_model[None]' \
	'tests/test_peft.py::test_lora_equals_peft[llama-1-2-2-2-1f1b-False-False-targets2-None-1]' \
	'tests/test_peft.py::test_dora_equals_peft[1-2-targets0]' \
	'tests/test_peft.py::test_lora_on_fused_experts_equals_peft[qwen3_moe-1-2-1-2-1-1-True-False-1f1b]' \
	'tests/test_peft.py::test_the_adapter_directory_is_what_peft_writes[CAUSAL_LM-1-1-2-1]' \
	'tests/test_peft.py::test_the_adapter_directory_is_what_peft_writes[None-2-2-1-1]' \
	tests/test_trainer.py::test_trainer_tp_pp_equals_one_process \
	tests/test_trainer.py::test_trainer_with_sharded_data_parallelism_equals_one_process \
	tests/test_trainer.py::test_trl_sft_trainer_through_the_mixin \
	'tests/test_mixed_precision.py::test_mixed_precision_trains_like_the_plain_model_by_hand[gpt2-2-2-2-2-True-bf16-1f1b]' \
	'tests/test_mixed_precision.py::test_mixed_precision_trains_like_the_plain_model_by_hand[llama-2-2-1-2-True-fp16-1f1b]' \
	'tests/test_every_stage.py::test_equal_to_the_plain_model[gemma3n-1-1-2-1f1b-2-layers_per_stage4-False]' \
	'tests/test_every_stage.py::test_equal_to_the_plain_model[gemma4-1-1-2-zb_h1-2-None-False]' \
	tests/test_every_stage.py::test_zero_equals_the_plain_model \
	'tests/test_generation.py::test_generate_equals_plain_model[dp1-tp2-pp2]' \
	'tests/test_generation.py::test_generate_with_expert_parallelism_equals_plain_model[dp2-pp2]' \
	'tests/test_pipeline_split.py::test_stages_receive_at_their_blocks_where_the_forward_transforms_the_embedding[granite-embedding_multiplier12.0-pp2]' \
	'tests/test_zoo.py::test_zoo[qwen3_moe-tp2pp2]' \
	'tests/test_zoo.py::test_zoo[gemma3_text-tp2pp2]' \
	'tests/test_zoo.py::test_zoo[qwen3_next-tp2pp2]'

# $(1): the venv, $(2): its torch, $(3): the transformers installed over the test extra's pin, $(4): its stamp
define release_venv
rm -f $(1)/.qn_hf-installed*
test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
$(1)/bin/python -m pip install --quiet --upgrade pip
$(1)/bin/python -m pip install --quiet torch==$(2)
$(1)/bin/python -m pip install --quiet -e ".[test]"
$(1)/bin/python -m pip install --quiet transformers==$(3)
$(1)/bin/python -c "import torch, transformers; assert (torch.__version__.split('+')[0], transformers.__version__) == ('$(2)', '$(3)')"
touch $(4)
endef

# $(1): the venv's python
define release_tests
OMP_NUM_THREADS=1 $(1) -m pytest -q -m "unit and not long"
OMP_NUM_THREADS=1 $(1) -m pytest -q $(COMPAT_TESTS)
endef

$(COMPAT_STAMP): pyproject.toml requirements/oldest.txt
	$(call release_venv,$(COMPAT_VENV),$(COMPAT_TORCH),$(COMPAT_TRANSFORMERS),$(COMPAT_STAMP))

$(NEWEST_STAMP): pyproject.toml requirements/newest.txt
	$(call release_venv,$(NEWEST_VENV),$(NEWEST_TORCH),$(NEWEST_TRANSFORMERS),$(NEWEST_STAMP))

test-compat: $(COMPAT_STAMP)
	$(call release_tests,$(COMPAT_VENV)/bin/python)

test-newest: $(NEWEST_STAMP)
	$(call release_tests,$(NEWEST_VENV)/bin/python)

# Rewrite qn_hf/config/composition_coverage.py from the tests' composes marks (pytest's collection, no test run),
# then docs/composition-table.md from it and qn_hf/config/composition.py (test_composition checks they agree).
composition-table: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest --collect-only -q -m "" -p no:cacheprovider \
	  --composition-table qn_hf/config/composition_coverage.py.tmp tests > /dev/null \
	  || { rm -f qn_hf/config/composition_coverage.py.tmp; exit 1; }
	mv qn_hf/config/composition_coverage.py.tmp qn_hf/config/composition_coverage.py
	{ printf '%s\n\n' '# Composition table'; \
	  printf '%s\n' 'Written by `make composition-table` from the tests'"'"' `composes` marks and' \
	    '`qn_hf/config/composition.py` (`composition_markdown.markdown()`); do not edit it by hand:' \
	    '`tests/test_composition.py` checks that this file holds the output of `markdown()`.' \
	    '[composition.md](composition.md) says what the marks, the rows and the symbols mean.' ''; \
	  $(BIN)/python -c "from qn_hf.config.composition_markdown import markdown; print(markdown(), end='')"; \
	} > docs/composition-table.md.tmp
	mv docs/composition-table.md.tmp docs/composition-table.md

# The zoo's full sweep: every type at the sp, cp2, ep2, tp2ep2 and pp2v2 columns (make test runs
# them for a few types only; test-all runs them too).
zoo-sweep: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m long tests/test_zoo.py

# Rerun the model zoo and rewrite tests/zoo_expected.json and docs/zoo-table.md from the results.
zoo-table: $(STAMP)
	QN_HF_ZOO_UPDATE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/test_zoo.py

# The heads zoo's full sweep: every model type under every head class of transformers' auto mappings (make test
# runs one class of each family), and rewriting tests/heads_zoo_expected.json and docs/heads-table.md from a run.
heads-sweep: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m long tests/test_heads_zoo.py

heads-table: $(STAMP)
	QN_HF_HEADS_UPDATE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/test_heads_zoo.py

# The results table (results/results.md, shown in docs/measured.md): ViT/GPT-2/Llama at (2,2,2) on 8
# processes beside 1-process baselines.
results: $(STAMP)
	$(BIN)/python scripts/results.py

# On a GPU machine: speed (eager and compiled), host syncs, ring attention's kernels, dp_shard on one rank and
# parity at every mesh that fits its GPUs, as one table (docs/gpu-check.md). A $(PYTHON) that imports a CUDA
# torch and transformers runs it as it is, nothing installed; elsewhere the CPU venv, as for make test.
gpu-check:
	@if $(PYTHON) -c "import sys, torch, transformers; sys.exit(torch.version.cuda is None)" 2>/dev/null; then \
		echo "gpu-check: $(PYTHON), its CUDA torch as it is"; \
		$(PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS); \
	else \
		$(MAKE) --no-print-directory -f $(firstword $(MAKEFILE_LIST)) install && \
		$(BIN)/python scripts/gpu_check.py $(GPU_CHECK_ARGS); \
	fi

bench: $(STAMP)
	$(BIN)/python benchmarks/tp_vs_dtensor.py
	$(BIN)/python benchmarks/pipeline.py
	$(BIN)/python benchmarks/data_parallel.py
	$(BIN)/python benchmarks/data_parallel.py --mesh 2,2,2
	$(BIN)/python benchmarks/convert.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(NEWEST_VENV) .pytest_cache

# The golden losses (tests/golden_losses.json), rewritten on purpose: the commit says why they moved.
golden: $(STAMP)
	QN_HF_GOLDEN_UPDATE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/test_golden.py
