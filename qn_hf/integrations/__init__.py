"""Integrations with libraries that drive a model: ``hf_trainer/`` (``qn_hf.Trainer``)."""
