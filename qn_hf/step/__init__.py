"""What one call on a ``ParallelModel`` computes: ``batch.py`` (checking and cutting a batch into
microbatches), ``loss.py`` (loss kinds, losses on vocabulary-parallel logits), ``logits.py``
(``pm.logits``), ``generation.py`` (``pm.generate``), ``compile.py`` (per-block ``torch.compile``)."""
