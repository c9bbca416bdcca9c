"""The switch and the autograd glue of the fused Triton kernels of the CCQ read of order 1
(`kernels.ccq_forward`, `kernels.ccq_backward`), which `ccq` takes on CUDA where they apply.

The kernels compute the series of order 1 (docs/operator.md) from a zero state, forward and backward;
the autograd Functions here save what the backward kernels reuse (the states entering every chunk)
and return the gradients in the inputs' dtypes. The kernel modules are imported when first called,
so importing `ccq` needs no triton.
"""

from __future__ import annotations

import os

import torch

KERNEL_ENV_VAR = "CCQ_EVAL_CCQ_KERNEL"


def fused_kernel_enabled() -> bool:
    """The fused Triton kernels (ccq_eval/model/kernels/ccq_*.py) are the default on CUDA;
    CCQ_EVAL_CCQ_KERNEL=unfused selects the unfused kernel path instead."""
    choice = os.environ.get(KERNEL_ENV_VAR, "fused").strip().lower()
    if choice not in ("fused", "unfused"):
        raise ValueError(f"{KERNEL_ENV_VAR} must be 'fused' or 'unfused', got {choice!r}")
    return choice == "fused"


def _fused_applies(r: torch.Tensor, order: int, form: str = "series") -> bool:
    """The fused kernels' domain: CUDA, not fp64, the series form of order 1, a head dim they support,
    not switched off."""
    if not (r.is_cuda and r.dtype != torch.float64 and form == "series" and order == 1
            and fused_kernel_enabled()):
        return False
    from ccq_eval.model.kernels.ccq_forward import supports_head_dim

    return supports_head_dim(r.shape[-1])


def _needs_grad(*tensors) -> bool:
    """Whether autograd will want gradients through these (the fused inference paths have none)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


class _FusedOrder1(torch.autograd.Function):
    """Order-1 read from a zero state with the fused Triton kernels, forward and backward."""

    @staticmethod
    def forward(ctx, r, kappa, log_gamma, lam, centered):
        from ccq_eval.model.kernels.ccq_forward import ccq_order1_forward

        r, kappa = r.contiguous(), kappa.to(r.dtype).contiguous()
        log_gamma, lam = log_gamma.float().contiguous(), lam.float().contiguous()
        q, (P, m, n), chunk_states = ccq_order1_forward(r, kappa, log_gamma, lam, centered,
                                                        output_final_state=True, return_chunk_states=True)
        ctx.save_for_backward(r, kappa, log_gamma, lam, *chunk_states)
        ctx.centered = centered
        ctx.mark_non_differentiable(P, m, n)
        return q, P, m, n

    @staticmethod
    def backward(ctx, dq, *_state_grads):
        from ccq_eval.model.kernels.ccq_backward import ccq_order1_backward

        r, kappa, log_gamma, lam, P_in, m_in, n_in = ctx.saved_tensors
        dr, dkappa, dlog_gamma, dlam = ccq_order1_backward(r, kappa, log_gamma, lam, dq, P_in, m_in, n_in,
                                                           centered=ctx.centered)
        return dr, dkappa, dlog_gamma, dlam, None


class _FusedOrder1Keys(torch.autograd.Function):
    """Training's order-1 read from a zero state on raw keys k and the gate (a, b, lam_max): the fused
    kernels normalise the keys and form lambda themselves, forward and backward, as for inference, so
    neither pass records or recomputes unit_keys or the gate's elementwise passes. The backward
    kernels apply their chain rules (kernels.ccq_backward.ccq_order1_backward):
      kappa = k / max(||k||, 1e-6):  dk = (dkappa - kappa (kappa . dkappa)) / ||k||  (dkappa / 1e-6 below it)
      lambda = lam_max sigmoid(a . r + b):  dlogit = dlambda lam_max s (1 - s),
      dr += dlogit a,  da = sum_t dlogit r,  db = sum_t dlogit."""

    @staticmethod
    def forward(ctx, r, k, log_gamma, gate_weight, gate_bias, lam_max, centered):
        from ccq_eval.model.kernels.ccq_forward import ccq_order1_forward

        r, keys, log_gamma = r.contiguous(), k.to(r.dtype).contiguous(), log_gamma.float().contiguous()
        q, (P, m, n), chunk_states = ccq_order1_forward(
            r, keys, log_gamma, None, centered, output_final_state=True, return_chunk_states=True,
            raw_keys=True, gate=(gate_weight, gate_bias, lam_max))
        ctx.save_for_backward(r, keys, log_gamma, gate_weight, gate_bias, *chunk_states)
        ctx.centered, ctx.lam_max, ctx.key_dtype = centered, float(lam_max), k.dtype
        ctx.mark_non_differentiable(P, m, n)
        return q, P, m, n

    @staticmethod
    def backward(ctx, dq, *_state_grads):
        from ccq_eval.model.kernels.ccq_backward import ccq_order1_backward

        r, keys, log_gamma, gate_weight, gate_bias, P_in, m_in, n_in = ctx.saved_tensors
        dr, dk, dlog_gamma, dlogit, d_weight = ccq_order1_backward(
            r, keys, log_gamma, None, dq, P_in, m_in, n_in, centered=ctx.centered, raw_keys=True,
            gate=(gate_weight, gate_bias, ctx.lam_max))
        # Gradients in the parameters' own dtypes (bf16 in a bf16 model). The constant gate (no weight)
        # adds nothing to dr.
        d_weight = None if gate_weight is None else d_weight.to(gate_weight.dtype)
        d_bias = dlogit.sum((0, 1)).to(gate_bias.dtype)
        return dr, dk.to(ctx.key_dtype), dlog_gamma, d_weight, d_bias, None, None
