"""Context parallelism: ``apply.py`` splits the sequence over cp ranks and routes attention through
transformers' attention interface to ``ring_attention.py``, exact causal attention over the ring; at
cp=1 ``host_masks.py`` decides the masks from the host batch as the ring does, through the same interface.
``costs.py`` is what cp costs, for the planner: the ring's stand-in in its meta trace and its transfers."""
