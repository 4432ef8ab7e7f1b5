"""Mesh shapes the parity tests cover: (kind, dp, tp, microbatches, padded)."""

PARITY_CASES = [
    # one rank: the sharding code path with tp=1
    ("gpt2", 1, 1, 2, False),
    ("llama", 1, 1, 1, False),
    ("vit", 1, 1, 1, False),
    # tp=2 (GPT-2 vocab 99 padded to 100; Llama KV heads split 2 -> 1 per rank)
    ("gpt2", 1, 2, 1, False),
    ("llama", 1, 2, 2, False),
    ("vit", 1, 2, 1, False),
    ("mistral", 1, 2, 1, False),
    ("qwen2", 1, 2, 1, False),
    # plain dp
    ("gpt2", 2, 1, 1, True),
    ("vit", 2, 1, 2, False),
    # tp=4 (Llama KV heads replicated on pairs of ranks; GPT-2 vocab padded to 100)
    ("gpt2", 1, 4, 1, False),
    ("llama", 1, 4, 1, True),
    ("vit", 1, 4, 2, False),
    # dp x tp
    ("gpt2", 2, 2, 2, True),
    ("llama", 2, 2, 1, False),
    ("vit", 2, 2, 1, False),
    # dp x tp = 8
    ("llama", 2, 4, 2, True),
    ("gpt2", 2, 4, 1, False),
    ("vit", 4, 2, 1, False),
    ("llama", 8, 1, 1, False),
]

# (kind, dp, tp, pp, schedule, microbatches, layers_per_stage). GPT-2 has 5 blocks (uneven by
# default), Llama and ViT 4; M covers 1, P, 2P and odd counts, including M < P.
PIPELINE_CASES = [
    ("gpt2", 1, 1, 2, "1f1b", 3, None),
    ("gpt2", 1, 1, 2, "gpipe", 4, None),
    ("gpt2", 1, 1, 4, "1f1b", 1, None),
    ("gpt2", 1, 1, 4, "gpipe", 8, None),
    ("gpt2", 1, 1, 4, "1f1b", 5, None),
    ("llama", 1, 1, 2, "1f1b", 2, None),
    ("llama", 1, 1, 2, "gpipe", 1, None),
    ("llama", 1, 1, 2, "1f1b", 4, [3, 1]),
    ("llama", 1, 1, 4, "1f1b", 3, None),
    ("llama", 1, 1, 4, "gpipe", 4, None),
    ("vit", 1, 1, 2, "1f1b", 4, None),
    ("vit", 1, 1, 2, "gpipe", 3, [1, 3]),
    ("vit", 1, 1, 4, "1f1b", 8, None),
    ("vit", 1, 1, 4, "gpipe", 1, None),
    # pp x tp = 2 x 2 (tied, vocab-padded embeddings across stages; GQA; ViT)
    ("gpt2", 1, 2, 2, "1f1b", 4, None),
    ("gpt2", 1, 2, 2, "gpipe", 3, None),
    ("llama", 1, 2, 2, "1f1b", 2, None),
    ("vit", 1, 2, 2, "gpipe", 2, None),
    # with dp
    ("gpt2", 2, 1, 2, "1f1b", 2, None),
    ("llama", 2, 2, 2, "1f1b", 4, None),
    ("gpt2", 2, 2, 2, "1f1b", 2, None),
    ("vit", 2, 2, 2, "gpipe", 2, None),
    # a policy derived from transformers' base_model_tp_plan / base_model_pp_plan
    ("mistral", 1, 2, 2, "1f1b", 2, None),
]

# Data parallelism composed with the other two, (kind, dp, tp, pp, schedule, microbatches).
DATA_PARALLEL_CASES = [
    (kind, dp, tp, pp, schedule, m)
    for kind in ("gpt2", "llama", "vit")
    for dp, tp, pp, schedule, m in ((2, 2, 2, "1f1b", 2), (4, 1, 2, "1f1b", 3), (2, 1, 2, "gpipe", 2), (8, 1, 1, "1f1b", 1))
]

# (kind, dp, tp, pp, schedule, virtual_stages, microbatches, layers_per_stage, rows per dp rank).
# 8 blocks over pp x V chunks; GPT-2's embedding is tied across the first and the last chunk.
# Interleaved M: pp, 2pp and odd counts the rounds rule allows (any M < 2pp); rows not divisible
# by M give microbatches of different sizes.
SCHEDULE_CASES = [
    ("llama_deep", 1, 1, 2, "interleaved_1f1b", 2, 2, None, None),
    ("gpt2_deep", 1, 1, 2, "interleaved_1f1b", 2, 4, None, None),
    ("gpt2_deep", 1, 1, 2, "interleaved_1f1b", 2, 3, None, 7),
    ("llama_deep", 1, 1, 2, "interleaved_1f1b", 4, 4, None, None),
    ("llama_deep", 1, 1, 2, "interleaved_1f1b", 2, 4, [3, 1, 2, 2], None),
    ("llama_deep", 1, 1, 4, "interleaved_1f1b", 2, 4, None, None),
    ("gpt2_deep", 1, 1, 4, "interleaved_1f1b", 2, 8, None, None),
    ("llama_deep", 1, 1, 4, "interleaved_1f1b", 2, 5, None, None),
    ("gpt2_deep", 1, 2, 2, "interleaved_1f1b", 2, 4, None, None),
    ("llama_deep", 1, 2, 2, "interleaved_1f1b", 2, 2, None, None),
    ("gpt2_deep", 2, 1, 2, "interleaved_1f1b", 2, 4, None, None),
    ("llama_deep", 2, 1, 2, "interleaved_1f1b", 2, 3, None, None),
    ("llama_deep", 2, 1, 2, "zb_h1", 1, 4, None, None),
    ("gpt2_deep", 2, 1, 2, "zb_h1", 1, 3, None, 5),
    ("llama_deep", 2, 1, 4, "zb_h1", 1, 4, None, None),
    ("gpt2_deep", 2, 1, 4, "zb_h1", 1, 8, None, None),
    ("gpt2_deep", 1, 2, 2, "zb_h1", 1, 4, None, None),
    ("llama", 1, 1, 1, "zb_h1", 1, 2, None, None),
    ("llama", 1, 1, 2, "1f1b", 1, 2, None, 5),
    ("gpt2", 2, 1, 1, "1f1b", 1, 2, None, 3),
]
# The rest of the grid (M = pp for GPT-2, M = 2pp for Llama at pp=4, odd M for GPT-2 at pp=4): `make test-all`.
SCHEDULE_CASES_LONG = [
    ("gpt2_deep", 1, 1, 2, "interleaved_1f1b", 2, 2, None, None),
    ("gpt2_deep", 1, 1, 4, "interleaved_1f1b", 2, 4, None, None),
    ("gpt2_deep", 1, 1, 4, "interleaved_1f1b", 2, 5, None, None),
    ("llama_deep", 1, 1, 4, "interleaved_1f1b", 2, 8, None, None),
    ("llama_deep", 2, 2, 2, "interleaved_1f1b", 2, 4, None, None),
    ("gpt2_deep", 2, 2, 2, "zb_h1", 1, 4, None, None),
]
