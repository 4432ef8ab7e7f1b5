"""What the launcher says of a job: its nodes, and this rank's place among them (``nodes.py``)."""
