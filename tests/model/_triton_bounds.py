"""A bounds check for Triton's interpreter (TRITON_INTERPRET=1): every load and store a kernel makes,
where its mask is true, must fall inside one of the tensors passed to that launch.

On a GPU an out-of-bounds access is an "illegal memory access" only when it leaves mapped memory,
and otherwise reads or overwrites a neighbour silently; the interpreter dereferences raw pointers
without any check. `install()` wraps the interpreter so that such an access raises, naming the
kernel, the operation and how far outside the nearest tensor it went.
"""

from __future__ import annotations

import numpy as np


class OutOfBounds(RuntimeError):
    pass


def _extent(tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] of a tensor view (strides may leave gaps, not overhang)."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), tensor.data_ptr()
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    return tensor.data_ptr(), tensor.data_ptr() + span * tensor.element_size()


def install():
    import torch
    import triton.runtime.interpreter as interpreter

    launch = {"kernel": None, "extents": []}
    init_args = interpreter.GridExecutor._init_args_hst

    def init_args_recording(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        launch["kernel"] = getattr(self.fn, "__name__", str(self.fn))
        launch["extents"] = [_extent(x) for x in [*args_hst, *kwargs_hst.values()] if isinstance(x, torch.Tensor)]
        return args_hst, kwargs_hst

    def check(op, ptrs, mask):
        addresses = np.broadcast_to(ptrs.data, np.broadcast_shapes(ptrs.data.shape, mask.data.shape))
        addresses = addresses[np.broadcast_to(mask.data, addresses.shape)].astype(np.int64)
        if addresses.size == 0:
            return
        width = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        low, high = int(addresses.min()), int(addresses.max()) + width
        # All addresses of one access must lie in one tensor that holds the lowest (several can, when
        # arguments are overlapping views of one buffer, e.g. q and k sliced from one q|k|v tensor).
        holding = [(start, end) for start, end in launch["extents"] if start <= low < end]
        if any(high <= end for _, end in holding):
            return
        if holding:
            start, end = max(holding, key=lambda e: e[1])
            raise OutOfBounds(f"{launch['kernel']}: {op} runs {(high - end) // width} elements past the end "
                              f"of a tensor of {(end - start) // width} elements")
        nearest = min(launch["extents"], key=lambda e: min(abs(low - e[0]), abs(low - e[1])))
        raise OutOfBounds(f"{launch['kernel']}: {op} starts outside every argument "
                          f"({(low - nearest[0]) // width:+d} elements from the nearest tensor's start)")

    builder = interpreter.InterpreterBuilder
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def checked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        check("load", ptrs, mask)
        return masked_load(self, ptrs, mask, other, cache_policy, is_volatile)

    def checked_store(self, ptrs, value, mask, cache_policy):
        check("store", ptrs, mask)
        return masked_store(self, ptrs, value, mask, cache_policy)

    interpreter.GridExecutor._init_args_hst = init_args_recording
    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
