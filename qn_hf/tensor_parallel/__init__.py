"""Tensor parallelism (and Megatron sequence parallelism inside it), one concept per file:

* ``plan.py``: policies (data) and their resolution against a model into a ``TpPlan``;
* ``patterns.py``: wildcard module names and where the base model sits in a task model;
* ``rules.py``: a policy rule checked against the module it names;
* ``styles.py``: the styles a rule can name and what each does;
* ``shard.py``: how one tensor is laid out over a tp group (``ShardSpec``);
* ``heads.py``: attention heads per rank at a tp degree;
* ``layers.py``, ``embeddings.py``, ``embedding_types.py``: the parallel ``Linear``/``Conv1D`` and
  ``Embedding`` replacements, and the embedding subclasses they reproduce;
* ``hooks.py``: styles carried out by hooks on an unchanged module;
* ``apply.py``: applying a resolved plan to a model;
* ``sequence_parallel.py``: the sequence split between tp regions, its checks and plan change;
  ``sequence_hooks.py``: the hooks that carry it out;
* ``replica_check.py``: the first step's proof that replicated gradients agree over tp;
* ``rng.py``: the two random streams that make dropout right under tp.
"""
