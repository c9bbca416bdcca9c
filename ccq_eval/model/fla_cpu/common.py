"""Helpers shared by the torch implementations of fla's ops: dtypes, padding, layouts, varlen, chunk scans."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_SIZE = 64
# Sub-block size used inside a GLA chunk: the per-channel decay between two positions of the same
# sub-block is evaluated exactly (elementwise), sub-blocks further apart factorise through the
# sub-block boundary with exponents <= 0, so nothing can overflow however strong the decay is.
GLA_SUB_BLOCK = 16
# Tokens processed together: bounds transient memory (the GLA sub-block tensor is S*K per token).
SEGMENT_TOKENS = 2048


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32 for half / bf16 / fp32 inputs, float64 if any input is float64."""
    dtype = torch.float32
    for tensor in tensors:
        if tensor is not None and tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def chunk_size_for(seq_len: int) -> int:
    # fla's rule for chunk_gla: short inputs use a smaller power-of-two chunk (>= 16).
    return min(CHUNK_SIZE, max(16, 1 << max(0, seq_len - 1).bit_length()))


def pad_time(x: torch.Tensor | None, pad: int, dim: int = 2) -> torch.Tensor | None:
    """Zero-pad the time axis `dim` at the end. Zero keys / betas / log decays add nothing."""
    if x is None or pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def heads_first(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[B, T, H, ...] -> [B, H, T, ...] in the compute dtype."""
    if x is None:
        return None
    return x.transpose(1, 2).to(dtype)


def to_k_first(state: torch.Tensor | None, state_v_first: bool, dtype: torch.dtype) -> torch.Tensor | None:
    if state is None:
        return None
    state = state.to(dtype)
    return state.transpose(-1, -2) if state_v_first else state


def from_k_first(state: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    return state.transpose(-1, -2).contiguous() if state_v_first else state


def check_varlen(
    q: torch.Tensor, cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None
) -> None:
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(
            f"cu_seqlens needs the batch size to be 1 (sequences packed along time), got {q.shape[0]}. "
            "Flatten the variable-length inputs to [1, total_tokens, ...] first."
        )
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(
            f"initial_state has {initial_state.shape[0]} states but cu_seqlens describes "
            f"{len(cu_seqlens) - 1} sequences; pass one state per sequence."
        )


def run_varlen(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    cu_seqlens: torch.Tensor,
    per_token: dict[str, torch.Tensor | None],
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run `fn` on each packed sequence of a [1, total, ...] batch separately and re-pack.

    Every per-token tensor is sliced on the time axis (dim 1); sequence i starts from
    initial_state[i]. Correct and simple; the cost is one Python call per sequence.
    """
    bounds = [int(b) for b in cu_seqlens.tolist()]
    outputs, finals = [], []
    for i in range(len(bounds) - 1):
        start, end = bounds[i], bounds[i + 1]
        sliced = {name: (t[:, start:end] if t is not None else None) for name, t in per_token.items()}
        h0 = initial_state[i : i + 1] if initial_state is not None else None
        o, ht = fn(
            **sliced, initial_state=h0, output_final_state=output_final_state, cu_seqlens=None, **kwargs
        )
        outputs.append(o)
        finals.append(ht)
    o = torch.cat(outputs, dim=1)
    return o, (torch.cat(finals, dim=0) if output_final_state else None)


def segment_ranges(num_chunks: int, chunk: int) -> list[tuple[int, int]]:
    """Chunk-index ranges [a, b) of at most SEGMENT_TOKENS tokens each."""
    per_segment = max(1, SEGMENT_TOKENS // chunk)
    return [(a, min(a + per_segment, num_chunks)) for a in range(0, num_chunks, per_segment)]


def scan_chunk_states(
    state: torch.Tensor,
    chunk_decay: torch.Tensor,
    chunk_update: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S_{n+1} = chunk_decay_n * S_n + chunk_update_n over the chunk axis (2).

    state [B, H, K, V]; chunk_decay broadcastable to [B, H, N, K, V]; chunk_update [B, H, N, K, V].
    Returns the state at the start of every chunk [B, H, N, K, V] and the final state.
    """
    starts = []
    for n in range(chunk_update.shape[2]):
        starts.append(state)
        state = chunk_decay[:, :, n] * state + chunk_update[:, :, n]
    return torch.stack(starts, dim=2), state


def causal_mask(size: int, device: torch.device, strict: bool = False) -> torch.Tensor:
    return torch.ones(size, size, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def relative_decay(cum: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """exp(cum_t - cum_s) for s <= t (s < t if strict), else 0; cum [..., C] -> [..., C, C].

    The exponent is masked to -inf *before* exp so that masked entries can never overflow.
    """
    diff = cum[..., :, None] - cum[..., None, :]
    mask = causal_mask(cum.shape[-1], cum.device, strict)
    return diff.masked_fill(~mask, float("-inf")).exp()


def maybe_checkpoint(fn: Callable, *args: torch.Tensor | None):
    if needs_grad(*args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


@dataclass(frozen=True)
class FlaOp:
    """One fla op: where fla defines it and what serves it off CUDA (an entry of dispatch.OPS).

    Args:
        module: the fla module that defines the op (the original is looked up there, never patched).
        torch_impl: the torch version; its parameter names are fla's.
        from_kwargs: names fla takes through `**kwargs` that the torch version honours.
        cuda_only: arguments that must be None off CUDA (NotImplementedError otherwise).
    """

    module: str
    torch_impl: Callable
    from_kwargs: tuple[str, ...] = ()
    cuda_only: tuple[str, ...] = ()
