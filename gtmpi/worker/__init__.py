"""A worker: its device (device.py), its executor (executor.py) and its message loop (loop.py)."""
