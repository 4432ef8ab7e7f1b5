"""The sections of ``scripts/gpu_check.py``, one file each: ``speed`` (tokens/s and memory, eager and compiled),
``syncs`` (host syncs per step and their sites), ``ring`` (context parallelism's kernels on a simulated ring),
``sharded`` (dp_shard's FSDP2 groups on one rank); ``common`` holds what they share. Each section is a function
``(*, quick) -> list of rows`` that runs on rank 0 of a world of one process."""
