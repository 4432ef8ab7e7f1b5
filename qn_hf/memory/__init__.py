"""Memory: ``recompute.py`` (activation recomputation through transformers' checkpointing hook) and
``live_allocations.py`` (the bytes an operation allocates and keeps, counted from real tensors)."""
