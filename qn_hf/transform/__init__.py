"""``parallelize``: a Hugging Face model transformed into its parallel form, in place. In the order it runs:
the checks (``validation/checks.py``: every check that can refuse, on every rank before any collective),
``passes.py`` (the in-place passes that shard the model, each after what it needs) and ``parallelize.py``
(``build``: check, join the process group and build the groups, run the passes, hand back the ``ParallelModel``).
``qn_hf.parallelize`` (``entry/``) chooses the configuration it builds, with the planner under ``mesh="auto"``."""
