"""Triton launches a kernel on the current CUDA device, not on the device of its tensors (fla wraps
its kernels in `input_guard` for this reason). The project's kernels launch inside `on_device_of`, so
that a model on cuda:1 works while cuda:0 is current (`ccq-eval run --device cuda:1`)."""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch


def on_device_of(x: torch.Tensor):
    """A context that makes x's GPU the current device (nothing for CPU tensors: the interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else nullcontext()


def launches_on_input_device(fn):
    """Runs fn with the device of its first tensor argument current."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        with on_device_of(first) if first is not None else nullcontext():
            return fn(*args, **kwargs)

    return wrapper
