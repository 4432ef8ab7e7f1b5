"""What one call on a ``ParallelModel`` computes: ``runner.py`` (the one step runner train_step,
eval_step and logits share), ``agreement.py`` (every rank's checks agreed before a collective),
``batch.py`` (checking and cutting a batch into microbatches), ``loss.py`` (losses on
vocabulary-parallel logits), ``logits.py`` (``pm.logits``), ``generation.py`` (``pm.generate``),
``compile.py`` (per-block ``torch.compile``)."""
