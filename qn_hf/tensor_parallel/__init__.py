"""Tensor parallelism (and Megatron sequence parallelism inside it), one concept per file (the
vocabulary a plan speaks, its styles, patterns and head layouts, is ``qn_hf/policies/``'s):

* ``plan.py``: a policy resolved against a model into a ``TpPlan``;
* ``rules.py``: a policy rule checked against the module it names;
* ``shard.py``: how one tensor is laid out over a tp group (``ShardSpec``);
* ``layers.py``, ``embeddings.py``: the parallel ``Linear``/``Conv1D`` and ``Embedding`` replacements;
* ``hooks.py``: styles carried out by hooks on an unchanged module;
* ``apply.py``: applying a resolved plan to a model;
* ``sequence_parallel.py``: the sequence split between tp regions, its checks and plan change;
  ``sequence_hooks.py``: the hooks that carry it out;
* ``replica_check.py``: the first step's proof that replicated gradients agree over tp;
* ``rng.py``: the two random streams that make dropout right under tp;
* ``sequence_costs.py``: what sequence parallelism costs, for the planner: its collectives' stand-ins in the meta
  trace and the stage edges' sizes.
"""
