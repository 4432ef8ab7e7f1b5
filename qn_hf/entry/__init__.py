"""``parallelize.py``: ``qn_hf.parallelize``, the user's one call: its keywords checked, the configuration given or
chosen by the planner (``mesh="auto"``), then ``transform.build``. The planner sits below it and above the
transform."""
