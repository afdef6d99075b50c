"""Launching a deployment: its config from flags, its processes on one machine or on Ray,
and ``pdkv run`` / ``pdkv serve``."""
