"""Trace replay on the scheduler core; run with `python -m scheduler.sim --help`."""
