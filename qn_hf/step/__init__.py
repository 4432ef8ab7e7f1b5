"""What one call on a ``ParallelModel`` computes: ``runner.py`` (the one step runner train_step,
eval_step and logits share), ``agreement.py`` (every rank's checks agreed before a collective),
``batch.py`` (checking and cutting a batch into microbatches), ``loss.py`` (losses on
vocabulary-parallel logits), ``step_loss.py`` (a step's loss, its counts and its sums over the mesh: the one
home of the loss train_step and eval_step return), ``loss_chunks.py`` (a causal LM's loss a chunk at a time),
``packed.py`` (packed sequences), ``logits.py`` (``pm.logits``), ``generation.py`` (``pm.generate``),
``compile.py`` (per-block ``torch.compile``)."""
