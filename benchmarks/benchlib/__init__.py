"""Pieces of benchmarks/bench.py: timing (timing.py), models and inputs (workload.py), the measured
sections (sections.py) and the JSON / markdown report (report.py)."""
