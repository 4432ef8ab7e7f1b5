"""``qn_hf.Trainer``: ``trainer.py`` (the Trainer and its mixin), ``args.py`` (what ``parallel=`` and
``TrainingArguments`` may say), ``data.py`` (how every rank reads the loader one process would)."""
