"""Every check ``parallelize`` runs before its first collective, one home each, shared with the
planner so that a mesh it accepts trains and one it rejects fails with the same message:
``checks.py`` (``check_parallel_config``: the composition table, then the model's structure under
the configuration: heads over tp, the pipeline cut, what cp, ep, recompute and compile need)."""
