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
