"""Data parallelism and what it owns of the optimizer step: ``buckets.py`` (gradient reduction over dp
overlapped with the backward), ``grad_sync.py`` (every gradient sum after a backward, in one place),
``grad_norm.py`` (the global norm and clipping), ``optimizer.py`` (``qn_hf.optimizer``: fp32 masters
and ZeRO-1, read by checkpoints through its ``OptimizerView``), ``precision.py`` (bf16/fp16 compute,
float32 accumulation, loss scaling), ``sharded.py`` (dp_shard over torch's FSDP2) and
``fsdp_internals.py`` (the one module that reads FSDP2's private state)."""
