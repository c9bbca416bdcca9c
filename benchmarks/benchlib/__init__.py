"""Pieces of benchmarks/bench.py: timing (timing.py), models and inputs (workload.py), the shared bench
context (bench_context.py), the measured sections (sections.py names them: compute_sections.py,
harness_section.py, generation_sections.py) and the JSON / markdown report (report.py)."""
