"""Context parallelism: ``apply.py`` splits the sequence over cp ranks and routes attention through
transformers' attention interface to ``ring_attention.py``, exact causal attention over the ring."""
