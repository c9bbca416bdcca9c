"""fla's chunk_bwd_dqkwg in torch, and the fla ops whose backward uses it where fla refuses the call
(fla #640: on Hopper with 3.4.0 <= Triton < 3.7.1 its kernel gives wrong results and fla raises).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from ccq_eval.model.fla_cpu.common import (
    CHUNK_SIZE,
    causal_mask,
    compute_dtype,
    heads_first,
    pad_time,
)
from ccq_eval.model.fla_cpu.rebinding import rebind


@dataclass(frozen=True)
class _Chunking:
    """How a length-T sequence splits into N chunks of C steps (the tail zero-padded), and the moves
    between fla's [B, T, heads, D] layout and the chunked [B, heads, N, C, D] one, in `dtype`."""

    B: int
    T: int
    C: int
    dtype: torch.dtype

    @property
    def N(self) -> int:
        return -(-self.T // self.C)

    @property
    def pad(self) -> int:
        return self.N * self.C - self.T

    def chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, heads, D] -> [B, heads, N, C, D] in the compute dtype, zero-padded tail."""
        x = pad_time(heads_first(x, self.dtype), self.pad)
        return x.reshape(self.B, x.shape[1], self.N, self.C, x.shape[-1])

    def unchunk(self, x: torch.Tensor) -> torch.Tensor:
        """[B, heads, N, C, *] -> [B, T, heads, *]."""
        return x.reshape(self.B, x.shape[1], self.N * self.C, *x.shape[4:])[:, :, : self.T].transpose(1, 2)

    def states(self, x: torch.Tensor, state_v_first: bool) -> torch.Tensor:
        """[B, N, HV, ., .] -> [B, HV, N, V, K]: V-first, the orientation the kernel loads."""
        x = x.to(self.dtype).transpose(1, 2)
        return x if state_v_first else x.transpose(-1, -2)


def _chunk_log2_decay(
    chunking: _Chunking, HV: int, g: torch.Tensor | None, g_gamma: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk-local cumulative log2 decay at every position [.., N, C] and at each chunk's last valid
    position [.., N] (from g, else from the per-step g_gamma, else zero), and each chunk's number of
    valid positions [N]."""
    B, T, C, N, dtype = chunking.B, chunking.T, chunking.C, chunking.N, chunking.dtype
    n_valid = (T - torch.arange(N, device=device) * C).clamp(max=C)
    if g is not None:
        gc = pad_time(g.to(dtype).transpose(1, 2), chunking.pad).reshape(B, HV, N, C)
        g_last = gc.gather(-1, (n_valid - 1).expand(B, HV, N)[..., None])[..., 0]
    elif g_gamma is not None:
        gamma = g_gamma.to(dtype)[:, None, None]  # [HV, 1, 1]
        gc = gamma * torch.arange(1, C + 1, device=device, dtype=dtype)
        g_last = gamma[..., 0] * n_valid.to(dtype)
    else:
        gc = torch.zeros(1, 1, N, C, device=device, dtype=dtype)
        g_last = gc[..., 0]
    return gc, g_last, n_valid


def _decay_factors(
    chunking: _Chunking, gc: torch.Tensor, g_last: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """decay_k [.., N, C]: the decay from each position to its chunk's last valid position; rel
    [.., N, C, C]: the decay from key position j to query position i of the same chunk (zero where j > i).
    The exponents are masked to -inf before exp2, so padded / acausal entries are exact zeros (no
    inf * 0)."""
    valid = torch.arange(chunking.N * chunking.C, device=device).reshape(chunking.N, chunking.C) < chunking.T
    decay_k = (g_last[..., None] - gc).masked_fill(~valid, float("-inf")).exp2()
    causal = causal_mask(chunking.C, device) & valid[:, :, None] & valid[:, None, :]
    rel = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp2()
    return decay_k, rel


def _query_key_grads(
    qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, doc: torch.Tensor, hs: torch.Tensor,
    dhs: torch.Tensor, gc: torch.Tensor, decay_k: torch.Tensor, rel: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked dq and dk (per value head), and dk's part through the chunk-end state (dk_inter):
    dq from the state at the chunk start and the intra-chunk scores, dk from the gradient of the
    chunk-end state and the intra-chunk scores."""
    ds = (doc @ vc.transpose(-1, -2)) * rel * scale  # dL/d(intra-chunk scores) [.., C, C]
    dq = (doc @ hs) * (gc.exp2()[..., None] * scale) + ds @ kc
    dk_inter = (vc @ dhs) * decay_k[..., None]
    dk = dk_inter + ds.transpose(-1, -2) @ qc
    return dq, dk, dk_inter


def _decay_grad(
    qc: torch.Tensor, kc: torch.Tensor, hs: torch.Tensor, dhs: torch.Tensor, dq: torch.Tensor,
    dk: torch.Tensor, dk_inter: torch.Tensor, g_last: torch.Tensor, n_valid: torch.Tensor,
) -> torch.Tensor:
    """Chunked dL/dg [B, HV, N, C] wrt the cumulative g: q.dq - k.dk at every position, plus at each
    chunk's last valid position the gradient through g_last of the chunk-end state."""
    C = qc.shape[-2]
    # d/dg_last of the chunk-end state exp2(g_last) h + sum_i exp2(g_last - g_i) k_i v_i^T
    dg_last = (hs * dhs).sum((-1, -2)) * g_last.exp2() + (dk_inter * kc).sum((-1, -2))
    dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)
    is_last = torch.arange(C, device=qc.device) == (n_valid - 1)[:, None]  # [N, C]
    return dg + is_last * dg_last[..., None]


def _sum_over_value_groups(x: torch.Tensor, H: int, HV: int) -> torch.Tensor:
    """[B, T, HV, K] -> [B, T, H, K]: a query/key head's gradient sums over the value heads sharing it."""
    if H == HV:
        return x
    B, T, _, K = x.shape
    return x.reshape(B, T, H, HV // H, K).sum(3)


def torch_chunk_bwd_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    w: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    chunk_indices: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """fla.ops.common.chunk_o.chunk_bwd_dqkwg (kernel chunk_bwd_kernel_dqkwg) in plain torch.

    Same signature (argument order q, k, v, do, h, dh, ...) and returns as fla's:
    q, k [B, T, H, K]; v, do, dv [B, T, HV, V]; w [B, T, HV, K]; g [B, T, HV] the chunk-local
    cumulative log decay in log2 units; g_gamma [HV] the per-step log2 decay (ignored when g is
    given, as in the kernel); h / dh [B, NT, HV, K, V] ([.., V, K] if state_v_first): the state at
    the start of chunk n and the gradient of the state at the end of chunk n.
    Returns dq [B, T, H, K] (q.dtype), dk (k.dtype), dw = -(dv @ h^T) (w.dtype, None without w),
    dg [B, T, HV] (None without g): the gradient wrt the cumulative g in natural-log units, before
    fla's within-chunk reverse cumsum; float32 like fla's (float64 for float64 inputs).
    All chunks at once; computed in float32 or wider.
    """
    if cu_seqlens is not None or chunk_indices is not None:
        raise NotImplementedError(
            "torch_chunk_bwd_dqkwg: variable-length inputs (cu_seqlens) are not supported."
        )
    if w is not None and dv is None:
        raise ValueError("torch_chunk_bwd_dqkwg: w (delta rule) needs dv.")
    B, T, H, K = k.shape
    HV = v.shape[2]
    chunking = _Chunking(B, T, chunk_size, compute_dtype(q, k, v, do, h, dh, w, dv, g, g_gamma))
    if scale is None:
        scale = K**-0.5

    # value head i uses query/key head i // (HV // H) (grouped value heads)
    qc = chunking.chunks(q).repeat_interleave(HV // H, dim=1)
    kc = chunking.chunks(k).repeat_interleave(HV // H, dim=1)
    vc, doc = chunking.chunks(v), chunking.chunks(do)
    hs, dhs = chunking.states(h, state_v_first), chunking.states(dh, state_v_first)

    gc, g_last, n_valid = _chunk_log2_decay(chunking, HV, g, g_gamma, q.device)
    decay_k, rel = _decay_factors(chunking, gc, g_last, q.device)
    dq, dk, dk_inter = _query_key_grads(qc, kc, vc, doc, hs, dhs, gc, decay_k, rel, scale)

    dg = None
    if g is not None:
        dg = chunking.unchunk(_decay_grad(qc, kc, hs, dhs, dq, dk, dk_inter, g_last, n_valid)).contiguous()
    dw = None
    if w is not None:
        dw = chunking.unchunk(-(chunking.chunks(dv) @ hs)).to(w.dtype).contiguous()

    dq = _sum_over_value_groups(chunking.unchunk(dq), H, HV)
    dk = _sum_over_value_groups(chunking.unchunk(dk), H, HV)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dw, dg


def _hits_fla_640(q: torch.Tensor, g: torch.Tensor | None) -> bool:
    """The guard in fla's chunk_bwd_dqkwg, on CUDA tensors: it raises exactly then."""
    return q.is_cuda and g is not None and hopper_triton_affected()


@cache
def hopper_triton_affected() -> bool:
    """Whether this machine is one where fla refuses chunk_bwd_dqkwg (fla #640: an NVIDIA Hopper GPU with
    3.4.0 <= Triton < 3.7.1, where its kernel gives wrong results)."""
    from fla.ops.common import chunk_o

    return chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1


def cuda_op(name: str) -> Callable:
    """What serves op `name` (a key of DQKWG_CALLERS) on CUDA: fla's function, or on a machine hit by fla #640
    the same op with a backward that works there (hopper_safe_op)."""
    if hopper_triton_affected():
        return hopper_safe_op(name)
    return _fla_function(DQKWG_CALLERS[name][0], name)


@cache
def _fla_function(module_name: str, name: str) -> Callable:
    import importlib

    return getattr(importlib.import_module(module_name), name)


def _hopper_dqkwg(original: Callable) -> Callable:
    def chunk_bwd_dqkwg(
        q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
        state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None,
    ):
        fn = torch_chunk_bwd_dqkwg if _hits_fla_640(q, g) else original
        return fn(
            q, k, v, do, h, dh, w=w, g=g, g_gamma=g_gamma, dv=dv, scale=scale, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens, chunk_size=chunk_size, chunk_indices=chunk_indices,
        )

    return chunk_bwd_dqkwg


# op -> (its module, the autograd Function it applies, the backward function that calls chunk_bwd_dqkwg):
# the fla ops our models reach whose backward calls it (fla.ops.gla's backward has its own kernels).
DQKWG_CALLERS = {
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule.chunk", "ChunkGatedDeltaRuleFunction",
                               "chunk_gated_delta_rule_bwd"),
    "chunk_simple_gla": ("fla.ops.simple_gla.chunk", "ChunkSimpleGLAFunction", "chunk_simple_gla_bwd"),
    "chunk_precond_gated_delta_rule": ("fla.ops.precond_gated_delta_rule.chunk", "ChunkPrecondGatedDeltaRuleFunction",
                                       "chunk_precond_gated_delta_rule_bwd"),
}


@cache
def hopper_safe_op(name: str) -> Callable:
    """fla's op `name` (a key of DQKWG_CALLERS) with its backward's chunk_bwd_dqkwg served by
    torch_chunk_bwd_dqkwg where fla refuses it (fla #640); everything else is fla's code.

    Built from fla's functions without changing them (rebinding.rebind): a copy of the backward function
    that calls our chunk_bwd_dqkwg, a subclass of fla's autograd Function whose backward (fla's code,
    fla's decorators) calls that copy, and a copy of the op's entry point that applies the subclass.
    The entry point skips fla's backend registry, so callers use it only on affected machines.
    """
    import importlib
    import inspect

    from fla.ops.common import chunk_o
    from fla.utils import autocast_custom_bwd, input_guard

    module_name, function_name, bwd_name = DQKWG_CALLERS[name]
    module = importlib.import_module(module_name)
    bwd = rebind(getattr(module, bwd_name), chunk_bwd_dqkwg=_hopper_dqkwg(chunk_o.chunk_bwd_dqkwg))
    function = getattr(module, function_name)
    backward = rebind(inspect.unwrap(function.backward), **{bwd_name: bwd})
    safe_function = type(function_name, (function,), {
        "backward": staticmethod(input_guard(autocast_custom_bwd(backward))), "__module__": __name__})
    return torch.compiler.disable(rebind(inspect.unwrap(getattr(module, name)), **{function_name: safe_function}))
