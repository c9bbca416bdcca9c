"""Timing and memory measurement that means the same thing on CUDA and on CPU.

CUDA: CUDA events recorded on the current stream around each call, read after the end event has
completed, so host-side overhead between launches (Python, tokenisation, .cpu() copies) is part of
the time, as it is for a user. CPU: time.perf_counter around each call (CPU work is synchronous).
Every measurement runs warm-up calls first (triton compilation and autotuning, allocator growth),
then `repeats` timed calls; the statistic reported is the median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stamp:
    """A point in time on `device`'s timeline: a recorded CUDA event, or perf_counter on CPU."""

    __slots__ = ("event", "host")

    def __init__(self, device: torch.device):
        self.event = None
        self.host = None
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.host = time.perf_counter()

    def ms_until(self, later: Stamp) -> float:
        """Milliseconds from this stamp to `later` (CUDA: call after `later` has completed)."""
        if self.event is not None:
            later.event.synchronize()
            return float(self.event.elapsed_time(later.event))
        return (later.host - self.host) * 1000.0


@dataclass
class Measurement:
    times_ms: list[float]
    first_call_ms: float | None  # the first warm-up call: includes compilation / autotuning
    peak_mem_bytes: int | None  # torch.cuda.max_memory_allocated over the timed calls (CUDA only)
    mem_before_bytes: int | None  # memory allocated before the timed calls (weights, inputs)
    extra: dict[str, Any] = field(default_factory=dict)
    # Host time of each timed call: until fn() returned, before the GPU finished. Close to times_ms:
    # the call is bound by the host (Python, launches), not by the GPU.
    host_times_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return float(statistics.median(self.times_ms))

    @property
    def min_ms(self) -> float:
        return float(min(self.times_ms))

    def as_dict(self) -> dict[str, Any]:
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "times_ms": [round(t, 4) for t in self.times_ms],
            "first_call_ms": self.first_call_ms,
            "peak_mem_bytes": self.peak_mem_bytes,
            "mem_before_bytes": self.mem_before_bytes,
            "host_median_ms": float(statistics.median(self.host_times_ms)) if self.host_times_ms else None,
        }


def reset_peak(device: torch.device) -> int | None:
    """Start a new peak-memory window; returns the memory allocated now (None on CPU)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_allocated(device))


def read_peak(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def measure(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> Measurement:
    """Median-ready timings of fn(): `warmup` untimed calls (the first one's wall time is kept),
    then `repeats` timed calls. Peak memory covers the timed calls only."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    first_call_ms = None
    for i in range(warmup):
        start = time.perf_counter()
        fn()
        synchronize(device)
        if i == 0:
            first_call_ms = (time.perf_counter() - start) * 1000.0
    mem_before = reset_peak(device)
    times, host_times = [], []
    for _ in range(repeats):
        begin, host_start = Stamp(device), time.perf_counter()
        fn()
        host_times.append((time.perf_counter() - host_start) * 1000.0)
        end = Stamp(device)
        times.append(begin.ms_until(end))  # waits for the call's GPU work: calls never overlap
    return Measurement(times, first_call_ms, read_peak(device), mem_before, host_times_ms=host_times)


def matmul_rate(
    device: torch.device, dtype: torch.dtype, size: int, *, warmup: int = 3, repeats: int = 10
) -> dict[str, Any]:
    """Measured dense matrix-product rate (FLOP/s) for size x size x size in `dtype`: the ceiling
    that model FLOP utilisation is reported against. Random inputs: zeros run faster on some GPUs."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    measurement = measure(lambda: torch.matmul(a, b, out=out), device, warmup=warmup, repeats=repeats)
    flops = 2.0 * size**3
    return {
        "size": size,
        "dtype": str(dtype).replace("torch.", ""),
        "median_ms": measurement.median_ms,
        "times_ms": measurement.times_ms,
        "flops_per_s": flops / (measurement.median_ms / 1000.0),
    }
