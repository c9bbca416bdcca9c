"""Norms, activations, short convolution and cross-entropy losses in torch, as fla.modules computes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ccq_eval.model.fla_cpu.common import (
    check_varlen,
    compute_dtype,
    run_varlen,
)


def _rms_normalise(x, weight, bias, residual, eps):
    """(x + residual) / rms * weight + bias in the compute dtype; also returns x + residual."""
    dtype = compute_dtype(x, residual)
    summed = x.to(dtype)
    if residual is not None:
        summed = summed + residual.to(dtype)
    y = summed * torch.rsqrt(summed.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    return y, summed


def _prenorm_residual(x, residual, summed, residual_in_fp32):
    """The residual stream fla returns with prenorm=True: x + residual in residual's dtype
    (fp32 if residual_in_fp32 and no residual was given, else x itself)."""
    if residual is not None:
        return summed.to(residual.dtype)
    if residual_in_fp32:
        return summed.to(torch.float32)
    return x


def torch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fla's RMSNorm with the optional fused residual add: y = rmsnorm(x + residual) in x.dtype;
    with prenorm=True returns (y, x + residual)."""
    y, summed = _rms_normalise(x, weight, bias, residual, eps)
    y = y.to(x.dtype)
    return (y, _prenorm_residual(x, residual, summed, residual_in_fp32)) if prenorm else y


def torch_rms_norm_gated(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str = "swish",
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fla's FusedRMSNormGated: rmsnorm(x) * act(g), act = swish/silu (g * sigmoid(g)) or sigmoid."""
    if activation not in ("swish", "silu", "sigmoid"):
        raise ValueError(
            f"rms_norm_gated: unsupported activation {activation!r}; use 'swish', 'silu' or 'sigmoid'."
        )
    y, summed = _rms_normalise(x, weight, bias, residual, eps)
    gf = g.to(compute_dtype(g, y))
    y = (y * (gf.sigmoid() if activation == "sigmoid" else F.silu(gf))).to(x.dtype)
    return (y, _prenorm_residual(x, residual, summed, residual_in_fp32)) if prenorm else y


def torch_swish(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x.to(compute_dtype(x))).to(x.dtype)


def torch_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return x.to(compute_dtype(x)).sigmoid().to(x.dtype)


def torch_logsigmoid(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return (F.logsigmoid(x.to(compute_dtype(x))) / temperature).to(x.dtype)


def torch_swiglu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """swish(x) * y, computed in fp32 (or wider), returned in x.dtype."""
    dtype = compute_dtype(x, y)
    return (F.silu(x.to(dtype)) * y.to(dtype)).to(x.dtype)


def torch_swiglu_linear(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return F.linear(torch_swiglu(x, y), weight, bias)


def _conv_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("swish", "silu"):
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"causal_conv1d: unsupported activation {activation!r}; use 'silu', 'swish' or None.")


def torch_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv: y_t = act(sum_i w[:, i] x_{t-W+1+i} + b) + residual_t.
    x [B, T, D]; weight [D, W]; initial_state / final state [N, D, W] = the last W inputs
    (index W-1 the most recent), which is what the decode step consumes."""
    if weight is None:
        raise ValueError("torch_causal_conv1d needs a weight of shape [D, W].")
    shape = x.shape
    if x.shape[-1] != weight.shape[0]:
        x = x.reshape(*x.shape[:2], -1)
    check_varlen(x, cu_seqlens, initial_state)
    if cu_seqlens is not None:

        def one_sequence(x, residual, initial_state, output_final_state, cu_seqlens):
            return torch_causal_conv1d(
                x, weight, bias, residual, initial_state, output_final_state, activation
            )

        y, final = run_varlen(
            one_sequence, cu_seqlens, {"x": x, "residual": residual}, initial_state, output_final_state
        )
        return y.view(shape), final
    B, T, D = x.shape
    W = weight.shape[1]
    dtype = compute_dtype(x, weight)
    history = initial_state.to(dtype) if initial_state is not None else x.new_zeros(B, D, W, dtype=dtype)
    full = torch.cat([history, x.to(dtype).transpose(1, 2)], dim=-1)  # [B, D, W + T]
    # y_t = sum_i w_i * input_{t-W+1+i}; input_t sits at column W + t of `full`. W shifted
    # multiply-adds: F.conv1d's depthwise path is orders of magnitude slower in float64.
    w = weight.to(dtype)
    y = sum(w[:, i, None] * full[..., 1 + i : 1 + i + T] for i in range(W)).transpose(1, 2)
    if bias is not None:
        y = y + bias.to(dtype)
    y = _conv_activation(y, activation)
    if residual is not None:
        y = y + residual.reshape(y.shape).to(dtype)
    final = full[..., -W:].to(x.dtype).contiguous() if output_final_state else None
    return y.to(x.dtype).view(shape), final


def torch_causal_conv1d_update(
    x: torch.Tensor,
    cache: torch.Tensor,
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step per sequence: x [N, D], [N, 1, D] or [1, N, D]; cache [N, D, W] is shifted
    left and x appended IN PLACE (as fla's kernel does), y = act(sum(cache * w) + b) + residual."""
    if weight is None:
        raise ValueError("torch_causal_conv1d_update needs a weight of shape [D, W].")
    shape = x.shape
    D, _W = weight.shape
    dtype = compute_dtype(x, weight)
    x_new = x.reshape(-1, D).to(dtype)
    window = torch.cat([cache[..., 1:].to(dtype), x_new[..., None]], dim=-1)  # [N, D, W]
    y = (window * weight.to(dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(dtype)
    y = _conv_activation(y, activation)
    if residual is not None:
        y = y + residual.reshape(y.shape).to(dtype)
    with torch.no_grad():
        cache.copy_(window)
    return y.to(x.dtype).view(shape), cache


def torch_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    lse_square_scale: float = 0.0,
    logit_softcapping: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's cross entropy on [N, V] logits: lse - (1-eps) x_y - eps mean(x) + z-loss, where
    z-loss = lse_square_scale * lse^2 is part of the loss. Returns (loss, z_loss), reduced over the
    non-ignored targets ('mean' / 'sum') or per row ('none'), in fp32 (fp64 for fp64 logits)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    x = logits.to(compute_dtype(logits)) * logit_scale
    if logit_softcapping is not None:
        x = logit_softcapping * torch.tanh(x / logit_softcapping)
    lse = torch.logsumexp(x, dim=-1)
    valid = target != ignore_index
    target_logit = x.gather(-1, torch.where(valid, target, 0)[:, None]).squeeze(-1)
    loss = lse - (1.0 - label_smoothing) * target_logit
    if label_smoothing > 0:
        loss = loss - label_smoothing * x.mean(-1)
    z_loss = lse_square_scale * lse.square()
    loss = torch.where(valid, loss + z_loss, 0.0)
    z_loss = torch.where(valid, z_loss, 0.0).detach()  # fla: logged, no own backward
    if reduction == "none":
        return loss, z_loss
    loss, z_loss = loss.sum(), z_loss.sum()
    if reduction == "mean":
        count = valid.sum()
        loss, z_loss = loss / count, z_loss / count
    return loss, z_loss
