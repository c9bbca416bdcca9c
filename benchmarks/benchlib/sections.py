"""The measured sections by name. Each takes the Bench context (bench_context.py) and appends rows to
bench.results[section]: model and ops (compute_sections.py), harness (harness_section.py), generation
and sniah (generation_sections.py).
"""

from __future__ import annotations

from collections.abc import Callable

from benchlib.bench_context import Bench
from benchlib.compute_sections import run_model, run_ops
from benchlib.generation_sections import run_generation, run_sniah
from benchlib.harness_section import run_harness

SECTIONS: dict[str, Callable[[Bench], None]] = {
    "model": run_model,
    "ops": run_ops,
    "harness": run_harness,
    "generation": run_generation,
    "sniah": run_sniah,
}
