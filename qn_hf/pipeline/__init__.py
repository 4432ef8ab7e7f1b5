"""Pipeline parallelism: stage splitting (split.py), schedules as data (schedule.py), the P2P executor (runtime.py)."""
