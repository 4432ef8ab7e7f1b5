"""The training recipe behind ``scripts/train_lm.py`` and ``scripts/train_vit.py``: config (YAML +
CLI), offline data through ``datasets``, per-dp-rank sampling, AdamW with warm-up and cosine decay,
evaluation, sharded checkpoints with resume, metrics, plots and the pipeline timeline.

Needs the ``train`` extra (``pip install qn_hf[train]``): datasets, PyYAML, matplotlib, scikit-learn.
"""
