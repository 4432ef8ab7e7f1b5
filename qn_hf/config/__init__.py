"""The configuration of a run as one value and what composes with what: ``validate.py`` (the checks
``parallelize``, the planner and ``qn-hf-check`` share)."""
