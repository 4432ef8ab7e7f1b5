"""What composes with what: one row of data per pair of features, and the one function that refuses.

Every pair of the features below is a row: it composes (and the test that compares it with the plain
model, or with a configuration that is itself compared with it, is named), it runs but no test
compares it yet (a warning says so), it is refused (the reason and what to use instead), or the two
cannot both be set. ``check_composition`` raises every refusal of a combination, with its message,
before any collective; ``parallelize``, ``qn_hf.optimizer``, ``pm.generate``, ``qn_hf.Trainer``,
``qn-hf-plan`` and ``qn-hf-check`` all call it. docs/composition-table.md is ``composition_markdown.markdown()``'s output
(tests/test_composition.py checks both, and that every named test exists).

Refusals that depend on the model rather than on a pair of features (cp on a model with sliding
windows, compile on any MoE model, LoRA variants at tp > 1, ...) stay with the feature's own checks.
"""

from __future__ import annotations

import enum
import itertools
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..arguments import Choice


class Feature(Choice):
    TP = "tp"
    SP = "sp"
    CP = "cp"
    PP_1F1B = "pp 1f1b"
    PP_GPIPE = "pp gpipe"
    PP_INTERLEAVED = "pp interleaved_1f1b"
    PP_ZB_H1 = "pp zb_h1"
    EP = "ep"
    EP_ALL_GATHER = "ep all_gather"  # expert_dispatch="all_gather" (config.options.Dispatch)
    DP = "dp"
    DP_SHARD = "dp_shard"
    ZERO = "zero"
    BF16 = "bf16"
    FP16 = "fp16"
    RECOMPUTE = "recompute"
    LOSS_CHUNKS = "loss chunks"  # loss_chunk_tokens: a causal LM's loss a chunk of tokens at a time
    OFFLOAD = "offload"  # offload="activations": what recomputation keeps, held on the host
    LORA = "lora"
    GENERATE = "generate"
    TRAINER = "trainer"
    COMPILE = "compile"

    @classmethod
    def for_schedule(cls, schedule: str) -> Feature:
        return cls(f"pp {schedule}")


class Status(enum.Enum):
    PLAIN = "composes: compared with the plain model"
    EQUIVALENT = "composes: compared with a configuration that is compared with the plain model"
    RUNS = "runs in a test, not compared numerically yet"
    UNTESTED = "not refused, not tested yet"
    REFUSED = "refused"
    EXCLUSIVE = "cannot both be set"


@dataclass(frozen=True)
class Row:
    first: Feature
    second: Feature
    status: Status
    test: str = ""  # tests/<file>.py::<function>[<id>] for PLAIN, EQUIVALENT and RUNS
    message: str = ""  # REFUSED: the refusal, formatted with the run's values; EXCLUSIVE: why

    @property
    def pair(self) -> frozenset[Feature]:
        return frozenset((self.first, self.second))


F, S = Feature, Status
_MP = "tests/test_mixed_precision.py::test_mixed_precision_trains_like_the_plain_model_by_hand"
_LORA = "tests/test_peft.py::test_lora_equals_peft"
_EP = "tests/test_expert_parallel.py::test_expert_parallel_equals_plain_model"
_EP_RC = "tests/test_expert_parallel.py::test_expert_parallel_with_recomputation"
_SP = "tests/test_sequence_parallel.py::test_sequence_parallel_equals_plain_model"
_CP = "tests/test_context_parallel.py::test_context_parallel_equals_plain_model"
_CP_SCHEDULES = "tests/test_context_parallel.py::test_context_parallel_with_schedules_equals_plain_model"
_EP_SCHEDULES = "tests/test_expert_parallel.py::test_expert_parallel_with_schedules_equals_plain_model"
_SP_ZB = "tests/test_sequence_parallel.py::test_sequence_parallel_with_zero_bubble_equals_plain_model"
_EP_CP = "tests/test_expert_parallel.py::test_expert_parallel_with_context_parallel_equals_plain_model"
_EP_GEN = "tests/test_generation.py::test_generate_with_expert_parallelism_equals_plain_model"
_CP_SP = "tests/test_context_parallel.py::test_context_parallel_with_sequence_parallelism_equals_plain_model"
_EP_SP = "tests/test_expert_parallel.py::test_expert_parallel_with_sequence_parallelism_equals_plain_model"
_GEN_MP = "tests/test_generation.py::test_generate_in_mixed_precision_equals_plain_model"
_TRAINER_MP = "tests/test_trainer.py::test_trainer_in_mixed_precision_follows_the_plain_run"
_EP_ZERO = "tests/test_expert_parallel.py::test_expert_parallel_with_zero_equals_plain_model"
_ZERO = "tests/test_optimizer.py::test_zero_equals_the_unsharded_optimizer"
_GEN = "tests/test_generation.py::test_generate_equals_plain_model"
_MPC = "tests/test_mixed_precision.py::test_mixed_precision_composes_with_sequence_parallelism_and_recomputation"
_COMPILED = "tests/test_compile.py::test_compiled_meshes"  # a long test (make test-all)
_COMPILED_NEW = "tests/test_compile.py::test_compiled_with_ring_experts_and_zero_bubble"
_TRAINER_RESUME = "tests/test_trainer.py::test_trainer_accumulation_clipping_checkpoint_and_resume_at_another_mesh"
_RC = "tests/test_recompute.py::test_recompute_is_bit_for_bit"
_TRAINER = "tests/test_trainer.py::test_trainer_composes_with_schedules_recompute_and_sp"
_LONG = "tests/test_long_context.py::test_long_context_equals_plain_model"
_LONG_EP = "tests/test_long_context.py::test_long_context_with_expert_parallelism"
_LONG_LORA = "tests/test_long_context.py::test_long_context_with_lora_zero_and_generate"
_LONG_MP = "tests/test_long_context.py::test_long_context_in_mixed_precision"
_RC_SCHEDULES = "tests/test_recompute.py::test_recompute_with_new_schedules"
_FSDP = "tests/test_sharded_data_parallel.py::test_sharded_data_parallel_equals_plain_model"
_FSDP_PP = "tests/test_sharded_data_parallel.py::test_sharded_data_parallel_with_pipeline_equals_plain_model"
_FSDP_MP = "tests/test_sharded_data_parallel.py::test_sharded_data_parallel_in_mixed_precision_trains_like_one_process"
_FSDP_LORA = "tests/test_sharded_data_parallel.py::test_sharded_data_parallel_with_lora_equals_peft"
_FSDP_GEN = _FSDP_LORA  # generate after the LoRA step gives peft's tokens
_AG = "tests/test_expert_parallel.py::test_all_gather_dispatch_equals_plain_model"

# Refused pairs first, in the order their messages win when a configuration hits several.
ROWS: tuple[Row, ...] = (
    # compile: what dynamo cannot trace runs eagerly between a block's compiled pieces (step/compile.py)
    Row(F.COMPILE, F.PP_ZB_H1, S.PLAIN, f"{_COMPILED_NEW}[zb_h1]"),
    Row(F.COMPILE, F.CP, S.PLAIN, f"{_COMPILED_NEW}[cp2]"),
    Row(F.COMPILE, F.EP, S.PLAIN, f"{_COMPILED_NEW}[dp2-ep2]"),
    # dp_shard (sharded data parallelism, data_parallel/sharded.py): what is not built on FSDP2 yet
    Row(F.DP_SHARD, F.ZERO, S.REFUSED, message=(
        "zero=True with dp_shard={dp_shard}: dp_shard already shards the optimizer state, the master weights, the "
        "gradients and the weights over its dp_shard ranks; leave zero=False (dp_shard=dp shards over every dp rank)")),
    Row(F.ZERO, F.EP, S.PLAIN, f"{_EP_ZERO}[qwen3_moe-2-2-1-2-None-all_to_all]"),
    # ring attention switched off: every cp rank holds the whole model and runs the loop on whole sequences
    Row(F.GENERATE, F.CP, S.PLAIN, "tests/test_generation.py::test_generate_equals_plain_model[dp1-tp1-pp2-cp2]"),
    # HF's synced_gpus: every rank calls the forward until all replicas' loops have finished
    Row(F.GENERATE, F.EP, S.PLAIN, f"{_EP_GEN}[dp2-pp1]"),
    # One schedule and one mixed_precision per run; the Trainer evaluates and predicts, it never generates.
    *(Row(a, b, S.EXCLUSIVE, message="one schedule per run")
      for a, b in itertools.combinations((F.PP_1F1B, F.PP_GPIPE, F.PP_INTERLEAVED, F.PP_ZB_H1), 2)),
    Row(F.BF16, F.FP16, S.EXCLUSIVE, message="one mixed_precision per run"),
    Row(F.GENERATE, F.TRAINER, S.EXCLUSIVE, message="the Trainer never generates (predict() is refused)"),
    # tp
    Row(F.TP, F.SP, S.PLAIN, f"{_SP}[llama-1-2-1-1-False]"),
    Row(F.TP, F.CP, S.PLAIN, f"{_CP}[llama-1-2-1-2-1-True-False]"),
    Row(F.TP, F.PP_1F1B, S.PLAIN, "tests/test_parity.py::test_pipeline[llama-1-2-2-1f1b-2-None]"),
    Row(F.TP, F.PP_GPIPE, S.PLAIN, "tests/test_parity.py::test_pipeline[gpt2-1-2-2-gpipe-3-None]"),
    Row(F.TP, F.PP_INTERLEAVED, S.PLAIN,
        "tests/test_parity.py::test_schedules[gpt2_deep-1-2-2-interleaved_1f1b-2-4-None-None]"),
    Row(F.TP, F.PP_ZB_H1, S.PLAIN, "tests/test_parity.py::test_schedules[gpt2_deep-1-2-2-zb_h1-1-4-None-None]"),
    Row(F.TP, F.EP, S.PLAIN, f"{_EP}[mixtral-2-2-1-4-1]"),
    Row(F.TP, F.DP, S.PLAIN, "tests/test_parity.py::test_tensor_and_data_parallel[llama-2-2-1-False]"),
    Row(F.TP, F.ZERO, S.PLAIN, f"{_ZERO}[llama-2-2-1-SGD-1f1b]"),
    Row(F.TP, F.BF16, S.PLAIN, f"{_MP}[gpt2-1-2-2-2-False-bf16-gpipe]"),
    Row(F.TP, F.FP16, S.PLAIN, f"{_MP}[llama-2-2-1-2-True-fp16-1f1b]"),
    Row(F.TP, F.RECOMPUTE, S.PLAIN, f"{_EP_RC}[deepseek_v3-2-2-1-4-selective]"),
    Row(F.TP, F.LORA, S.PLAIN, f"{_LORA}[llama-1-2-1-1-1f1b-False-False-targets0-None-1]"),
    Row(F.TP, F.GENERATE, S.PLAIN, f"{_GEN}[dp1-tp2-pp1]"),
    Row(F.TP, F.TRAINER, S.PLAIN, "tests/test_trainer.py::test_trainer_tp_pp_equals_one_process"),
    Row(F.TP, F.COMPILE, S.PLAIN, "tests/test_compile.py::test_compiled_tensor_parallel"),
    # sp
    Row(F.SP, F.PP_1F1B, S.PLAIN, f"{_SP}[llama-1-2-2-2-True]"),
    Row(F.SP, F.PP_GPIPE, S.PLAIN, "tests/test_sequence_parallel.py::test_sequence_parallel_with_gpipe_equals_plain_model"),
    Row(F.SP, F.PP_INTERLEAVED, S.PLAIN,
        "tests/test_sequence_parallel.py::test_sequence_parallel_with_interleaved_chunks[llama_deep]"),
    Row(F.SP, F.DP, S.PLAIN, f"{_SP}[llama-2-2-1-2-True]"),
    Row(F.SP, F.ZERO, S.PLAIN, f"{_MPC}[llama-2-2-1-True-bf16-None-True-1]"),
    Row(F.SP, F.BF16, S.PLAIN, f"{_MPC}[llama-2-2-1-True-bf16-None-True-1]"),
    Row(F.SP, F.FP16, S.PLAIN, f"{_MPC}[llama-1-2-1-False-fp16-None-True-1]"),
    Row(F.SP, F.RECOMPUTE, S.EQUIVALENT, f"{_RC}[gpt2-1-2-1-full-True-1]"),
    Row(F.SP, F.LORA, S.PLAIN, f"{_LORA}[llama-2-2-1-1-1f1b-True-False-targets3-None-1]"),
    Row(F.SP, F.TRAINER, S.PLAIN, f"{_TRAINER}[sequence_parallel=True]"),
    # generate switches sequence parallelism off: a one-token step cannot be split over the tp ranks
    Row(F.SP, F.GENERATE, S.PLAIN, f"{_GEN}[dp1-tp2-pp2-sp]"),
    Row(F.SP, F.COMPILE, S.PLAIN, f"{_COMPILED}[llama-2-dp=1-tp=2-sequence_parallel=True]"),
    # cp
    # slices of slices: each cp rank's two pieces split again over tp between the tp regions
    Row(F.SP, F.CP, S.PLAIN, f"{_CP_SP}[llama-1-2-1-1]"),
    Row(F.CP, F.PP_1F1B, S.PLAIN, f"{_CP}[llama-1-1-2-2-2-True-False]"),
    Row(F.CP, F.PP_GPIPE, S.PLAIN, "tests/test_context_parallel.py::test_context_parallel_with_gpipe_equals_plain_model"),
    Row(F.CP, F.DP, S.PLAIN, f"{_CP}[llama-2-1-1-2-1-True-False]"),
    Row(F.CP, F.ZERO, S.PLAIN, f"{_MPC}[llama-1-1-1-True-bf16-None-False-2]"),
    Row(F.CP, F.BF16, S.PLAIN, f"{_MPC}[llama-1-1-1-True-bf16-None-False-2]"),
    Row(F.CP, F.FP16, S.PLAIN, f"{_MPC}[llama-1-1-1-True-fp16-None-False-2]"),
    Row(F.CP, F.RECOMPUTE, S.EQUIVALENT, f"{_RC}[llama-1-1-1-full-False-2]"),
    Row(F.CP, F.LORA, S.PLAIN, f"{_LORA}[llama-1-2-1-1-1f1b-False-True-targets10-None-2]"),
    Row(F.CP, F.TRAINER, S.PLAIN, f"{_TRAINER}[cp=2]"),
    # every cp rank routes its own tokens within its grid's ep group; the experts' gradients sum over cp too
    Row(F.CP, F.EP, S.PLAIN, f"{_EP_CP}[qwen3_moe-2-1-2-2-True]"),
    # the schedules
    Row(F.PP_1F1B, F.EP, S.PLAIN, f"{_EP}[mixtral-2-1-2-2-2]"),
    Row(F.PP_1F1B, F.DP, S.PLAIN, "tests/test_parity.py::test_data_parallel_3d[gpt2-4-1-2-1f1b-3]"),
    Row(F.PP_1F1B, F.ZERO, S.PLAIN, f"{_MP}[gpt2-2-2-2-2-True-bf16-1f1b]"),
    Row(F.PP_1F1B, F.BF16, S.PLAIN, f"{_MP}[gpt2-2-2-2-2-True-bf16-1f1b]"),
    Row(F.PP_1F1B, F.FP16, S.PLAIN, f"{_MP}[llama-1-1-2-2-False-fp16-1f1b]"),
    Row(F.PP_1F1B, F.RECOMPUTE, S.PLAIN, f"{_EP_RC}[mixtral-2-1-2-2-selective]"),
    Row(F.PP_1F1B, F.LORA, S.PLAIN, f"{_LORA}[llama-1-1-2-2-1f1b-False-False-targets1-None-1]"),
    Row(F.PP_1F1B, F.GENERATE, S.PLAIN, f"{_GEN}[dp1-tp1-pp2]"),
    Row(F.PP_1F1B, F.TRAINER, S.PLAIN, "tests/test_trainer.py::test_trainer_tp_pp_equals_one_process"),
    Row(F.PP_1F1B, F.COMPILE, S.PLAIN, "tests/test_compile.py::test_compiled_data_and_pipeline_parallel"),
    Row(F.PP_GPIPE, F.EP, S.PLAIN, "tests/test_expert_parallel.py::test_expert_parallel_with_gpipe_equals_plain_model"),
    Row(F.PP_GPIPE, F.DP, S.PLAIN, "tests/test_parity.py::test_data_parallel_3d[gpt2-2-1-2-gpipe-2]"),
    Row(F.PP_GPIPE, F.ZERO, S.PLAIN, f"{_ZERO}[gpt2-2-1-2-SGD-gpipe]"),
    Row(F.PP_GPIPE, F.BF16, S.PLAIN, f"{_MP}[gpt2-1-2-2-2-False-bf16-gpipe]"),
    Row(F.PP_GPIPE, F.FP16, S.PLAIN, f"{_MP}[gpt2-1-2-2-2-False-fp16-gpipe]"),
    Row(F.PP_GPIPE, F.RECOMPUTE, S.EQUIVALENT, f"{_RC_SCHEDULES}[gpt2_deep-2-gpipe-1-full]"),
    Row(F.PP_GPIPE, F.LORA, S.PLAIN, f"{_LORA}[llama-1-2-2-2-gpipe-False-False-targets8-None-1]"),
    Row(F.PP_GPIPE, F.GENERATE, S.PLAIN, f"{_LORA}[llama-1-2-2-2-gpipe-False-False-targets8-None-1]"),  # generate equals peft's after a gpipe step
    Row(F.PP_GPIPE, F.TRAINER, S.PLAIN, f"{_TRAINER}[schedule=gpipe]"),
    Row(F.PP_GPIPE, F.COMPILE, S.PLAIN, f"{_COMPILED}[gpt2-4-dp=1-tp=2-pp=2-microbatches=2-schedule=gpipe]"),
    Row(F.PP_INTERLEAVED, F.CP, S.PLAIN, f"{_CP_SCHEDULES}[interleaved_1f1b-2-2]"),
    Row(F.PP_INTERLEAVED, F.EP, S.PLAIN, f"{_EP_SCHEDULES}[interleaved_1f1b-2]"),
    Row(F.PP_INTERLEAVED, F.DP, S.PLAIN,
        "tests/test_parity.py::test_schedules[gpt2_deep-2-1-2-interleaved_1f1b-2-4-None-None]"),
    Row(F.PP_INTERLEAVED, F.ZERO, S.EQUIVALENT, f"{_ZERO}[llama-2-1-2-AdamW-interleaved_1f1b]"),
    Row(F.PP_INTERLEAVED, F.BF16, S.PLAIN, f"{_MP}[gpt2-1-2-2-2-False-bf16-interleaved_1f1b]"),
    Row(F.PP_INTERLEAVED, F.FP16, S.PLAIN, f"{_MP}[gpt2-1-2-2-2-False-fp16-interleaved_1f1b]"),
    Row(F.PP_INTERLEAVED, F.RECOMPUTE, S.EQUIVALENT, f"{_RC_SCHEDULES}[gpt2_deep-1-interleaved_1f1b-2-full]"),
    Row(F.PP_INTERLEAVED, F.LORA, S.PLAIN, f"{_LORA}[llama_deep-1-1-2-2-interleaved_1f1b-False-False-targets9-None-1]"),
    Row(F.PP_INTERLEAVED, F.TRAINER, S.PLAIN, f"{_TRAINER}[schedule=interleaved_1f1b-virtual_stages=2]"),
    # each generated token's forward goes round the ring of stages once per chunk
    Row(F.PP_INTERLEAVED, F.GENERATE, S.PLAIN, "tests/test_generation.py::test_generate_equals_plain_model[dp1-tp1-pp2-v2]"),
    Row(F.PP_INTERLEAVED, F.COMPILE, S.PLAIN,
        f"{_COMPILED}[llama_deep-2-dp=1-tp=1-pp=2-microbatches=2-schedule=interleaved_1f1b-virtual_stages=2]"),
    # a deferred W of a column layer reads the input sp gathered for its forward (held from B to W)
    Row(F.PP_ZB_H1, F.SP, S.PLAIN, _SP_ZB),
    Row(F.PP_ZB_H1, F.CP, S.PLAIN, f"{_CP_SCHEDULES}[zb_h1-1-2]"),
    Row(F.PP_ZB_H1, F.EP, S.PLAIN, f"{_EP_SCHEDULES}[zb_h1-1]"),
    Row(F.PP_ZB_H1, F.DP, S.PLAIN, "tests/test_parity.py::test_schedules[llama_deep-2-1-2-zb_h1-1-4-None-None]"),
    Row(F.PP_ZB_H1, F.ZERO, S.PLAIN, f"{_ZERO}[gpt2-2-1-2-SGD-zb_h1]"),
    Row(F.PP_ZB_H1, F.BF16, S.PLAIN, f"{_MP}[llama-2-1-2-2-True-bf16-zb_h1]"),
    Row(F.PP_ZB_H1, F.FP16, S.PLAIN, f"{_MP}[llama-2-1-2-2-True-fp16-zb_h1]"),
    Row(F.PP_ZB_H1, F.RECOMPUTE, S.EQUIVALENT, f"{_RC_SCHEDULES}[gpt2_deep-1-zb_h1-1-full]"),
    Row(F.PP_ZB_H1, F.LORA, S.PLAIN, f"{_LORA}[llama-2-1-2-2-zb_h1-False-True-targets4-None-1]"),
    Row(F.PP_ZB_H1, F.GENERATE, S.PLAIN, f"{_LORA}[llama-2-1-2-2-zb_h1-False-True-targets4-None-1]"),
    Row(F.PP_ZB_H1, F.TRAINER, S.PLAIN, f"{_TRAINER}[schedule=zb_h1]"),
    # ep
    # the MoE block runs on this rank's slice of the sequence: its tokens are distinct, nothing is shared out over tp
    Row(F.EP, F.SP, S.PLAIN, f"{_EP_SP}[qwen3_moe-1-2-1-2-False]"),
    Row(F.EP, F.DP, S.PLAIN, f"{_EP}[mixtral-2-1-1-2-1]"),
    Row(F.EP, F.BF16, S.EQUIVALENT,
        "tests/test_expert_parallel.py::test_expert_parallel_in_bf16_trains_like_replicated_experts"),
    Row(F.EP, F.FP16, S.EQUIVALENT, "tests/test_expert_parallel.py::test_expert_parallel_in_bf16_trains_like_replicated_experts[fp16]"),
    Row(F.EP, F.RECOMPUTE, S.PLAIN, f"{_EP_RC}[qwen3_moe-2-1-1-2-full]"),
    # LoRA on the attention and on the fused experts' weights, whose factors ep cuts into expert blocks
    Row(F.EP, F.LORA, S.PLAIN,
        "tests/test_peft.py::test_lora_on_fused_experts_equals_peft[qwen3_moe-2-1-1-2-1-1-False-False-1f1b]"),
    Row(F.EP, F.TRAINER, S.PLAIN, "tests/test_trainer.py::test_trainer_with_expert_parallelism_equals_one_process"),
    # ep's all-gather dispatch (expert_dispatch="all_gather"): a way of running ep, tested with each feature
    Row(F.EP_ALL_GATHER, F.EP, S.PLAIN, f"{_AG}[mixtral-dp2-ep2]"),
    Row(F.EP_ALL_GATHER, F.DP, S.PLAIN, f"{_AG}[mixtral-dp2-ep2]"),
    # tokens shared out over tp: a share one token short padded with a token routed nowhere
    Row(F.EP_ALL_GATHER, F.TP, S.PLAIN, f"{_AG}[qwen3_moe-tp2-ep2-odd]"),
    Row(F.EP_ALL_GATHER, F.SP, S.PLAIN, f"{_AG}[qwen3_moe-tp2-ep2-sp]"),
    Row(F.EP_ALL_GATHER, F.CP, S.PLAIN, f"{_AG}[qwen3_moe-dp2-cp2-ep2]"),
    Row(F.EP_ALL_GATHER, F.PP_1F1B, S.PLAIN, f"{_AG}[mixtral-dp2-pp2-ep2]"),
    Row(F.EP_ALL_GATHER, F.PP_GPIPE, S.PLAIN, f"{_AG}[qwen3_moe-dp2-pp2-ep2-gpipe]"),
    Row(F.EP_ALL_GATHER, F.PP_INTERLEAVED, S.PLAIN, f"{_AG}[qwen3_moe-dp2-pp2-ep2-interleaved_1f1b]"),
    Row(F.EP_ALL_GATHER, F.PP_ZB_H1, S.PLAIN, f"{_AG}[qwen3_moe-dp2-pp2-ep2-zb_h1]"),
    Row(F.EP_ALL_GATHER, F.DP_SHARD, S.PLAIN, f"{_AG}[qwen3_moe-dp2-shard2-ep2-full]"),
    Row(F.EP_ALL_GATHER, F.ZERO, S.PLAIN, f"{_EP_ZERO}[qwen3_moe-2-2-1-2-None-all_gather]"),
    Row(F.EP_ALL_GATHER, F.BF16, S.EQUIVALENT,
        "tests/test_expert_parallel.py::test_expert_parallel_in_bf16_trains_like_replicated_experts[bf16-all_gather]"),
    Row(F.EP_ALL_GATHER, F.FP16, S.EQUIVALENT,
        "tests/test_expert_parallel.py::test_expert_parallel_in_bf16_trains_like_replicated_experts[fp16-all_gather]"),
    Row(F.EP_ALL_GATHER, F.RECOMPUTE, S.PLAIN, f"{_AG}[deepseek_v3-dp2-tp2-ep4-selective]"),
    Row(F.EP_ALL_GATHER, F.LORA, S.PLAIN,
        "tests/test_expert_parallel.py::test_lora_with_expert_parallelism_equals_peft[qwen3_moe-2-1-2-all_gather]"),
    # generate runs the all-to-all: its replicas' prompts need not be alike (dispatch.GatherSwitch)
    Row(F.EP_ALL_GATHER, F.GENERATE, S.PLAIN, f"{_EP_GEN}[dp2-pp1-all_gather]"),
    Row(F.EP_ALL_GATHER, F.TRAINER, S.PLAIN,
        "tests/test_trainer.py::test_trainer_with_expert_parallelism_equals_one_process[all_gather]"),
    Row(F.EP_ALL_GATHER, F.COMPILE, S.PLAIN, f"{_COMPILED_NEW}[dp2-ep2-all_gather]"),
    # dp_shard
    Row(F.DP_SHARD, F.DP, S.PLAIN, f"{_FSDP}[llama-dp4-shard2-tp1]"),
    Row(F.DP_SHARD, F.TP, S.PLAIN, f"{_FSDP}[gpt2-dp2-shard2-tp2]"),
    Row(F.DP_SHARD, F.SP, S.PLAIN, f"{_FSDP}[llama-dp2-shard2-tp2-sp]"),
    Row(F.DP_SHARD, F.RECOMPUTE, S.PLAIN, f"{_FSDP}[gpt2-dp2-shard2-tp1-full]"),
    # each block compiled in place, FSDP's hooks on it run eagerly around its graph (step/compile.py)
    Row(F.DP_SHARD, F.COMPILE, S.PLAIN, "tests/test_compile.py::test_compiled_sharded_data_parallel"),
    # each stage's own FSDP groups, reduced once per step after its last backward and weight pass
    Row(F.DP_SHARD, F.PP_1F1B, S.PLAIN, f"{_FSDP_PP}[llama-dp2-shard2-tp1-pp2-1f1b-step]"),
    Row(F.DP_SHARD, F.PP_GPIPE, S.PLAIN, f"{_FSDP_PP}[gpt2-dp2-shard2-tp1-pp2-gpipe-step]"),
    Row(F.DP_SHARD, F.PP_INTERLEAVED, S.PLAIN, f"{_FSDP_PP}[llama-dp2-shard2-tp1-pp2-interleaved_1f1b-step]"),
    Row(F.DP_SHARD, F.PP_ZB_H1, S.PLAIN, f"{_FSDP_PP}[llama-dp2-shard2-tp1-pp2-zb_h1-step]"),
    # cp ranks hold the same weights and sum their gradients as dp ranks do: sharded over dp_shard x cp
    Row(F.DP_SHARD, F.CP, S.PLAIN, f"{_FSDP}[llama-dp2-shard2-tp1-cp2]"),
    # the experts in FSDP groups of their own over the ranks holding the same experts
    Row(F.DP_SHARD, F.EP, S.PLAIN,
        "tests/test_sharded_data_parallel.py::test_sharded_data_parallel_with_expert_parallelism_equals_plain_model"),
    # FSDP's own mixed precision: float32 sharded parameters (the masters), gathered in the compute dtype
    Row(F.DP_SHARD, F.BF16, S.EQUIVALENT, f"{_FSDP_MP}[bf16]"),
    Row(F.DP_SHARD, F.FP16, S.EQUIVALENT, f"{_FSDP_MP}[fp16]"),
    Row(F.DP_SHARD, F.LORA, S.PLAIN, _FSDP_LORA),
    Row(F.DP_SHARD, F.GENERATE, S.PLAIN, _FSDP_GEN),
    Row(F.DP_SHARD, F.TRAINER, S.PLAIN,
        "tests/test_trainer.py::test_trainer_with_sharded_data_parallelism_equals_one_process"),
    # dp
    Row(F.DP, F.ZERO, S.PLAIN, f"{_ZERO}[llama-2-2-1-SGD-1f1b]"),
    Row(F.DP, F.BF16, S.PLAIN, f"{_MP}[gpt2-2-2-2-2-True-bf16-1f1b]"),
    Row(F.DP, F.FP16, S.PLAIN, f"{_MP}[llama-2-2-1-2-True-fp16-1f1b]"),
    Row(F.DP, F.RECOMPUTE, S.PLAIN, f"{_EP_RC}[qwen3_moe-2-1-1-2-full]"),
    Row(F.DP, F.LORA, S.PLAIN, f"{_LORA}[llama-2-2-1-1-1f1b-True-False-targets3-None-1]"),
    Row(F.DP, F.GENERATE, S.PLAIN, f"{_GEN}[dp2-tp1-pp2]"),
    Row(F.DP, F.TRAINER, S.PLAIN, _TRAINER_RESUME),
    Row(F.DP, F.COMPILE, S.PLAIN, "tests/test_compile.py::test_compiled_data_and_pipeline_parallel"),
    # zero
    Row(F.ZERO, F.BF16, S.PLAIN, f"{_MP}[gpt2-2-2-2-2-True-bf16-1f1b]"),
    Row(F.ZERO, F.FP16, S.PLAIN, f"{_MP}[llama-2-2-1-2-True-fp16-1f1b]"),
    Row(F.ZERO, F.RECOMPUTE, S.PLAIN, f"{_MPC}[llama-2-1-1-True-fp16-full-False-1]"),
    Row(F.ZERO, F.LORA, S.PLAIN, f"{_LORA}[llama-2-1-2-2-zb_h1-False-True-targets4-None-1]"),
    Row(F.ZERO, F.GENERATE, S.PLAIN, f"{_LORA}[llama-2-1-2-2-zb_h1-False-True-targets4-None-1]"),
    Row(F.ZERO, F.TRAINER, S.PLAIN, _TRAINER_RESUME),
    Row(F.ZERO, F.COMPILE, S.PLAIN, f"{_COMPILED}[llama-2-dp=2-tp=1-zero=True]"),
    # precision
    Row(F.BF16, F.RECOMPUTE, S.PLAIN, f"{_MPC}[gpt2-1-2-2-False-bf16-selective-False-1]"),
    Row(F.BF16, F.LORA, S.PLAIN, "tests/test_peft.py::test_lora_bf16_keeps_masters_for_the_adapter_only"),
    Row(F.BF16, F.GENERATE, S.PLAIN, f"{_GEN_MP}[bf16]"),
    Row(F.BF16, F.TRAINER, S.PLAIN, f"{_TRAINER_MP}[bf16]"),
    Row(F.BF16, F.COMPILE, S.RUNS, "tests/test_compile.py::test_compiled_mixed_precision"),  # bf16: 4.03% vs a 4% bound
    Row(F.FP16, F.RECOMPUTE, S.PLAIN, f"{_MPC}[llama-2-1-1-True-fp16-full-False-1]"),
    Row(F.FP16, F.LORA, S.PLAIN, "tests/test_peft.py::test_lora_bf16_keeps_masters_for_the_adapter_only[fp16]"),
    Row(F.FP16, F.GENERATE, S.PLAIN, f"{_GEN_MP}[fp16]"),
    Row(F.FP16, F.TRAINER, S.PLAIN, f"{_TRAINER_MP}[fp16]"),
    Row(F.FP16, F.COMPILE, S.EQUIVALENT, "tests/test_compile.py::test_compiled_mixed_precision[fp16]"),
    # recompute, LoRA, generate, Trainer, compile
    Row(F.RECOMPUTE, F.LORA, S.PLAIN, f"{_LORA}[llama-1-2-2-2-1f1b-False-False-targets7-selective-1]"),
    Row(F.RECOMPUTE, F.GENERATE, S.PLAIN, f"{_LORA}[llama-1-2-2-2-1f1b-False-False-targets7-selective-1]"),
    Row(F.RECOMPUTE, F.TRAINER, S.PLAIN, f"{_TRAINER}[recompute=full]"),
    Row(F.RECOMPUTE, F.COMPILE, S.PLAIN, f"{_COMPILED}[llama-2-dp=1-tp=2-recompute=selective]"),
    Row(F.LORA, F.GENERATE, S.PLAIN, f"{_LORA}[llama-1-2-1-1-1f1b-False-False-targets0-None-1]"),
    Row(F.LORA, F.TRAINER, S.PLAIN, "tests/test_trainer.py::test_trainer_with_lora_writes_the_adapter"),
    Row(F.LORA, F.COMPILE, S.EQUIVALENT, "tests/test_compile.py::test_compiled_lora"),
    Row(F.GENERATE, F.COMPILE, S.PLAIN, "tests/test_compile.py::test_compiled_generate_equals_plain_model[2-1]"),
    Row(F.TRAINER, F.COMPILE, S.EQUIVALENT, "tests/test_compile.py::test_trainer_with_torch_compile"),
    # the loss a chunk of positions at a time (loss_chunk_tokens): the task forward's own head code (step/loss_chunks.py)
    Row(F.LOSS_CHUNKS, F.DP, S.PLAIN, f"{_LONG}[chunks-llama-dp2]"),
    Row(F.LOSS_CHUNKS, F.TP, S.PLAIN, f"{_LONG}[chunks-gemma2-tp2]"),  # each chunk's loss over the vocabulary shards
    Row(F.LOSS_CHUNKS, F.SP, S.PLAIN, f"{_LONG}[chunks-gpt2-tp2-sp]"),
    Row(F.LOSS_CHUNKS, F.CP, S.PLAIN, f"{_LONG}[chunks-llama-cp2]"),
    Row(F.LOSS_CHUNKS, F.PP_1F1B, S.PLAIN, f"{_LONG}[chunks-llama-dp2-pp2-1f1b]"),
    Row(F.LOSS_CHUNKS, F.PP_GPIPE, S.PLAIN, f"{_LONG}[chunks-llama-tp2-pp2-gpipe]"),
    Row(F.LOSS_CHUNKS, F.PP_INTERLEAVED, S.PLAIN, f"{_LONG}[chunks-llama_deep-pp2-interleaved_1f1b]"),
    Row(F.LOSS_CHUNKS, F.PP_ZB_H1, S.PLAIN, f"{_LONG}[chunks-llama-pp2-zb_h1]"),
    Row(F.LOSS_CHUNKS, F.EP, S.PLAIN, f"{_LONG_EP}[chunks-all_to_all]"),
    Row(F.LOSS_CHUNKS, F.EP_ALL_GATHER, S.PLAIN, f"{_LONG_EP}[chunks-all_gather]"),
    Row(F.LOSS_CHUNKS, F.DP_SHARD, S.PLAIN, f"{_LONG}[chunks-llama-dp2-shard2]"),  # inside FSDP's root gather
    Row(F.LOSS_CHUNKS, F.ZERO, S.PLAIN, f"{_LONG_LORA}[chunks]"),
    Row(F.LOSS_CHUNKS, F.BF16, S.PLAIN, f"{_LONG_MP}[chunks-dp2-zero-bf16]"),
    Row(F.LOSS_CHUNKS, F.FP16, S.PLAIN, f"{_LONG_MP}[chunks-tp2-sp-fp16]"),
    Row(F.LOSS_CHUNKS, F.RECOMPUTE, S.PLAIN, f"{_LONG}[chunks-llama-dp2]"),
    Row(F.LOSS_CHUNKS, F.OFFLOAD, S.PLAIN, f"{_LONG}[both-llama-dp2-shard2-cp2]"),
    Row(F.LOSS_CHUNKS, F.LORA, S.PLAIN, f"{_LONG_LORA}[chunks]"),
    Row(F.LOSS_CHUNKS, F.GENERATE, S.PLAIN, f"{_LONG_LORA}[chunks]"),  # generate computes no loss
    Row(F.LOSS_CHUNKS, F.TRAINER, S.PLAIN, f"{_TRAINER}[loss_chunk_tokens=5]"),
    Row(F.LOSS_CHUNKS, F.COMPILE, S.PLAIN, f"{_COMPILED_NEW}[dp2-loss_chunks]"),
    # what recomputation keeps of each block, held on the host (offload="activations", memory/offload.py)
    Row(F.OFFLOAD, F.DP, S.PLAIN, f"{_LONG}[offload-llama-dp2]"),
    Row(F.OFFLOAD, F.TP, S.PLAIN, f"{_LONG}[offload-gemma2-tp2]"),
    Row(F.OFFLOAD, F.SP, S.PLAIN, f"{_LONG}[offload-gpt2-tp2-sp]"),  # each tp rank's slice of the sequence
    Row(F.OFFLOAD, F.CP, S.PLAIN, f"{_LONG}[offload-llama-cp2]"),
    Row(F.OFFLOAD, F.PP_1F1B, S.PLAIN, f"{_LONG}[offload-llama-dp2-pp2-1f1b]"),
    Row(F.OFFLOAD, F.PP_GPIPE, S.PLAIN, f"{_LONG}[offload-llama-tp2-pp2-gpipe]"),
    Row(F.OFFLOAD, F.PP_INTERLEAVED, S.PLAIN, f"{_LONG}[offload-llama_deep-pp2-interleaved_1f1b]"),
    Row(F.OFFLOAD, F.PP_ZB_H1, S.PLAIN, f"{_LONG}[offload-llama-pp2-zb_h1]"),
    Row(F.OFFLOAD, F.EP, S.PLAIN, f"{_LONG_EP}[offload-all_to_all]"),
    Row(F.OFFLOAD, F.EP_ALL_GATHER, S.PLAIN, f"{_LONG_EP}[offload-all_gather]"),
    Row(F.OFFLOAD, F.DP_SHARD, S.PLAIN, f"{_LONG}[offload-llama-dp2-shard2]"),
    Row(F.OFFLOAD, F.ZERO, S.PLAIN, f"{_LONG_LORA}[offload]"),
    Row(F.OFFLOAD, F.BF16, S.PLAIN, f"{_LONG_MP}[offload-dp2-zero-bf16]"),
    Row(F.OFFLOAD, F.FP16, S.PLAIN, f"{_LONG_MP}[offload-tp2-sp-fp16]"),
    Row(F.OFFLOAD, F.RECOMPUTE, S.PLAIN, f"{_LONG}[offload-llama-dp2]"),  # needs it: refused without
    Row(F.OFFLOAD, F.LORA, S.PLAIN, f"{_LONG_LORA}[offload]"),
    Row(F.OFFLOAD, F.GENERATE, S.PLAIN, f"{_LONG_LORA}[offload]"),  # generate recomputes nothing
    Row(F.OFFLOAD, F.TRAINER, S.PLAIN, f"{_TRAINER}[recompute=selective-offload=activations]"),
    Row(F.OFFLOAD, F.COMPILE, S.PLAIN, f"{_COMPILED_NEW}[dp2-offload]"),
)
TABLE: dict[frozenset[Feature], Row] = {row.pair: row for row in ROWS}


def check_composition(features: Iterable[Feature], values: Mapping[str, object] | None = None) -> list[Row]:
    """Raise the ``ValueError`` of the first refused pair among ``features`` (table order), its
    message formatted with ``values`` (cp, ep, pp, schedule, virtual_stages, model_type as the run has
    them); otherwise return the pairs no test compares yet, for the caller to warn about once."""
    used = frozenset(features)
    hits = [row for row in ROWS if row.pair <= used]
    for row in hits:
        if row.status is Status.REFUSED:
            raise ValueError(row.message.format(**(values or {})))
    return [row for row in hits if row.status in (Status.RUNS, Status.UNTESTED)]


def check_and_warn(features: Iterable[Feature], values: Mapping[str, object], *, warned: set[frozenset[Feature]],
                   rank: int) -> None:
    """``check_composition``, then one warning on rank 0 naming the untested pairs not in ``warned``
    (which it extends), so a run hears about each once."""
    fresh = [row for row in check_composition(features, values) if row.pair not in warned]
    if fresh and rank == 0:
        pairs = ", ".join(f"{row.first} x {row.second}" for row in fresh)
        warnings.warn(f"no test compares {pairs} with the plain model yet: it runs, but check its loss against a "
                      f"smaller run (docs/composition-table.md lists what is tested)", stacklevel=4)
    warned |= {row.pair for row in fresh}
