"""The Curvature-Conditioned Query (CCQ) read operator, in three forms that must agree.

Definition (docs/operator.md, per layer, head h and position t):
    kappa_t = k_t / max(||k_t||, 1e-6)                     unit keys
    w_{i,t} = prod_{j=i+1..t} gamma_j,  n_t = sum_i w_{i,t}  decayed counts
    mu_t = (1/n_t) sum_i w_{i,t} kappa_i,  M_t = (1/n_t) sum_i w_{i,t} kappa_i kappa_i^T
    Sigma_t = M_t - mu_t mu_t^T  (centered)   or   M_t  (uncentered)
    q~_t = sum_{j=0..R} (-lambda_t Sigma_t)^j r_t          form "series" (R = ccq_order)
    q~_t ~= (I + lambda_t Sigma_t)^-1 r_t                   form "resolvent" (S = ccq_solve_steps)

The read form only decides what is done with each Sigma u (`ccq_read_forms`: the series, and the
resolvent by S conjugate-gradient steps); the three forms below differ only in how they apply Sigma,
so they agree for either read. `order` below is the count of Sigma applications for either read
form. The fused Triton kernels implement the series of order 1 only (`ccq_fused` holds their switch
and autograd glue); the resolvent always takes the unfused paths.

Forms:
- `ccq_read_reference`: parallel O(T^2) over a T x T decay matrix (the ground truth for tests).
- `ccq_read_chunk`: chunkwise, O(T * C) memory. On CUDA the unfused kernel path: per order a K x K
  covariance pass with fla's chunk_simple_gla (q = u, k = v = kappa, scalar log decay, scale 1), m and
  n as batched decayed sums. By default order 1 runs through the fused Triton kernels of
  `kernels.ccq_forward` / `kernels.ccq_backward` instead, forward and backward
  (CCQ_EVAL_CCQ_KERNEL=unfused switches them off). On CPU a torch chunk loop applies all orders per
  chunk in one pass.
- `ccq_read_recurrent`: token by token with the decoding state (P, m, n).

Shapes: r, kappa [B, T, H, K]; log_gamma, lam [B, T, H]. The state is a `CCQState` of fp32 (or fp64
when the inputs are fp64) tensors P [B, H, K, K], m [B, H, K], n [B, H]; it covers every position
before the current call, so chunked prefill and decoding continue exactly where they stopped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ccq_eval.model.ccq_fused import (  # noqa: F401  (re-exported: the kernel switch, for the harness)
    KERNEL_ENV_VAR,
    _fused_applies,
    _FusedOrder1,
    _FusedOrder1Keys,
    _needs_grad,
    fused_kernel_enabled,
)
from ccq_eval.model.ccq_read_forms import (  # noqa: F401  (re-exported: the forms, for models and diagnostics)
    CCQ_FORMS,
    apply_read_form,
    sigma_passes,
)


class CCQState(NamedTuple):
    P: torch.Tensor  # [B, H, K, K] decayed sum of kappa kappa^T
    m: torch.Tensor  # [B, H, K]    decayed sum of kappa
    n: torch.Tensor  # [B, H]       decayed count


def unit_keys(k: torch.Tensor) -> torch.Tensor:
    """kappa = k / max(||k||, 1e-6): bounds the spectrum of Sigma to [0, 1]."""
    return k / k.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def _state_dtype(x: torch.Tensor) -> torch.dtype:
    # The state accumulates over 20K+ tokens: keep it in fp32 at least.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def zero_state(batch: int, heads: int, dim: int, device, dtype=torch.float32) -> CCQState:
    return CCQState(
        torch.zeros(batch, heads, dim, dim, device=device, dtype=dtype),
        torch.zeros(batch, heads, dim, device=device, dtype=dtype),
        torch.zeros(batch, heads, device=device, dtype=dtype),
    )


def _apply_sigma(Pu: torch.Tensor, m: torch.Tensor, n: torch.Tensor, u: torch.Tensor, centered: bool):
    """Sigma u from the decayed sums: (P u)/n - mu (mu . u), with mu = m / n. n is [..., 1]."""
    out = Pu / n
    if centered:
        mu = m / n
        out = out - mu * (mu * u).sum(-1, keepdim=True)
    return out


def _check(r, kappa, log_gamma, lam, order, form="series"):
    if form not in CCQ_FORMS:
        raise ValueError(f"ccq_form must be one of {CCQ_FORMS}, got {form!r}")
    if r.dim() != 4 or kappa.shape != r.shape:
        raise ValueError(f"r and kappa must both be [B, T, H, K]; got {tuple(r.shape)} and {tuple(kappa.shape)}")
    if log_gamma.shape != r.shape[:3] or lam.shape != r.shape[:3]:
        raise ValueError(
            f"log_gamma and lam must be [B, T, H] = {tuple(r.shape[:3])}; "
            f"got {tuple(log_gamma.shape)} and {tuple(lam.shape)}"
        )
    if order < 1:
        name = "ccq_order" if form == "series" else "ccq_solve_steps"
        raise ValueError(f"{name} must be >= 1, got {order}")


def ccq_read_reference(
    r: torch.Tensor,
    kappa: torch.Tensor,
    log_gamma: torch.Tensor,
    lam: torch.Tensor,
    order: int = 1,
    centered: bool = True,
    initial_state: CCQState | None = None,
    *,
    form: str = "series",
) -> tuple[torch.Tensor, CCQState]:
    """Parallel O(T^2) form: materialises w_{i,t} for all pairs. For tests and small T only."""
    _check(r, kappa, log_gamma, lam, order, form)
    B, T, H, _ = r.shape
    acc = _state_dtype(r)
    rr, kk, lam_ = r.to(acc), kappa.to(acc), lam.to(acc).unsqueeze(-1)
    c = log_gamma.to(acc).cumsum(1)  # [B, T, H]: log prod_{j<=t} gamma_j
    # w[b, h, t, i] = exp(c_t - c_i) for i <= t, else 0
    diff = c.permute(0, 2, 1).unsqueeze(-1) - c.permute(0, 2, 1).unsqueeze(-2)
    causal = torch.ones(T, T, dtype=torch.bool, device=r.device).tril()
    w = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
    past = c.exp()  # [B, T, H]: decay of the initial state up to t
    kh = kk.permute(0, 2, 1, 3)  # [B, H, T, K]
    n = w.sum(-1)  # [B, H, T]
    m = w @ kh
    if initial_state is not None:
        P0, m0, n0 = (s.to(acc) for s in initial_state)
        n = n + past.permute(0, 2, 1) * n0.unsqueeze(-1)
        m = m + past.permute(0, 2, 1).unsqueeze(-1) * m0.unsqueeze(2)

    def sigma_times(u: torch.Tensor) -> torch.Tensor:
        uh = u.permute(0, 2, 1, 3)  # [B, H, T, K]
        scores = w * (uh @ kh.transpose(-1, -2))  # [B, H, t, i] = w_{i,t} (kappa_i . u_t)
        Pu = scores @ kh
        if initial_state is not None:
            Pu = Pu + past.permute(0, 2, 1).unsqueeze(-1) * (uh @ P0.transpose(-1, -2))
        out = _apply_sigma(Pu, m, n.unsqueeze(-1), uh, centered)
        return out.permute(0, 2, 1, 3)

    q = apply_read_form(form, rr, lam_, order, sigma_times)
    # Final state: the decayed sums at the last position.
    wT = w[:, :, -1, :]  # [B, H, T]
    P = torch.einsum("bhi,bhik,bhil->bhkl", wT, kh, kh)
    if initial_state is not None:
        P = P + past[:, -1].reshape(B, H, 1, 1) * P0
    return q.to(r.dtype), CCQState(P, m[:, :, -1], n[:, :, -1])


def ccq_read_recurrent(
    r: torch.Tensor,
    kappa: torch.Tensor,
    log_gamma: torch.Tensor,
    lam: torch.Tensor,
    order: int = 1,
    centered: bool = True,
    initial_state: CCQState | None = None,
    *,
    form: str = "series",
) -> tuple[torch.Tensor, CCQState]:
    """Token-by-token recurrence: P_t = gamma_t P_{t-1} + kappa kappa^T, m_t, n_t alike."""
    _check(r, kappa, log_gamma, lam, order, form)
    B, T, H, K = r.shape
    acc = _state_dtype(r)
    if initial_state is None:
        initial_state = zero_state(B, H, K, r.device, acc)
    P, m, n = (s.to(acc) for s in initial_state)
    outputs = []
    for t in range(T):
        kap = kappa[:, t].to(acc)  # [B, H, K]
        gamma = log_gamma[:, t].to(acc).exp()  # [B, H]
        P = gamma[..., None, None] * P + kap.unsqueeze(-1) * kap.unsqueeze(-2)
        m = gamma[..., None] * m + kap
        n = gamma * n + 1
        n_ = n.unsqueeze(-1)

        def sigma_times(u, P=P, m=m, n_=n_):
            return _apply_sigma((P @ u.unsqueeze(-1)).squeeze(-1), m, n_, u, centered)

        lam_t = lam[:, t].to(acc).unsqueeze(-1)
        outputs.append(apply_read_form(form, r[:, t].to(acc), lam_t, order, sigma_times))
    q = torch.stack(outputs, 1) if outputs else r.to(acc)
    return q.to(r.dtype), CCQState(P, m, n)


def _decayed_sums_chunk(kappa_c, b, state: CCQState):
    """Within one chunk: D[t, i] = exp(b_t - b_i) (i <= t), and the running m_t, n_t.

    kappa_c [B, C, H, K] and b [B, C, H] (cumulative log decay inside the chunk) in the accumulation
    dtype. Returns D [B, H, C, C], m [B, H, C, K], n [B, H, C].
    """
    C = b.shape[1]
    bh = b.permute(0, 2, 1)  # [B, H, C]
    diff = bh.unsqueeze(-1) - bh.unsqueeze(-2)
    causal = torch.ones(C, C, dtype=torch.bool, device=b.device).tril()
    D = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()
    carry = bh.exp()  # decay of the state entering the chunk
    kh = kappa_c.permute(0, 2, 1, 3)
    n = carry * state.n.unsqueeze(-1) + D.sum(-1)
    m = carry.unsqueeze(-1) * state.m.unsqueeze(2) + D @ kh
    return D, m, n, carry, kh


def _ccq_chunk_torch(r, kappa, log_gamma, lam, order, centered, state: CCQState, chunk_size: int,
                     form: str = "series"):
    T = r.shape[1]
    acc = state.P.dtype
    outputs = []
    P, m_state, n_state = state
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        kap = kappa[:, start:end].to(acc)
        b = log_gamma[:, start:end].to(acc).cumsum(1)
        D, m, n, carry, kh = _decayed_sums_chunk(kap, b, CCQState(P, m_state, n_state))
        n_ = n.unsqueeze(-1)

        def sigma_times(uh, D=D, kh=kh, carry=carry, P=P, m=m, n_=n_):
            # uh [B, H, C, K]: intra-chunk part + the state carried in from earlier chunks.
            Pu = (D * (uh @ kh.transpose(-1, -2))) @ kh + carry.unsqueeze(-1) * (uh @ P.transpose(-1, -2))
            return _apply_sigma(Pu, m, n_, uh, centered)

        rh = r[:, start:end].to(acc).permute(0, 2, 1, 3)
        lam_h = lam[:, start:end].to(acc).permute(0, 2, 1).unsqueeze(-1)
        outputs.append(apply_read_form(form, rh, lam_h, order, sigma_times).permute(0, 2, 1, 3))
        # Advance the state to the end of the chunk.
        w_last = D[:, :, -1, :]  # [B, H, C] = exp(b_last - b_i)
        P = carry[:, :, -1, None, None] * P + torch.einsum("bhi,bhik,bhil->bhkl", w_last, kh, kh)
        m_state, n_state = m[:, :, -1], n[:, :, -1]
    q = torch.cat(outputs, 1) if outputs else r.to(acc)
    return q.to(r.dtype), CCQState(P, m_state, n_state)


def decayed_sums(kappa, log_gamma, state: CCQState, chunk_size: int):
    """m_t = sum_i w_{i,t} kappa_i and n_t = sum_i w_{i,t} (plus the decayed initial m, n) for every t,
    all chunks at once: dense decays inside a chunk, an NC x NC matrix of chunk-to-chunk decays across
    chunks (no Python loop over chunks, so autograd and CUDA see a handful of batched kernels).

    kappa [B, T, H, K], log_gamma [B, T, H]; returns m [B, H, T, K], n [B, H, T] in the state dtype.
    """
    acc = state.P.dtype
    B, T, H, K = kappa.shape
    C = chunk_size
    NC = -(-T // C)
    pad = NC * C - T
    # Padded steps (zero key, log decay 0) sit after the last real position and are cut off below.
    kap = torch.nn.functional.pad(kappa.to(acc), (0, 0, 0, 0, 0, pad)).view(B, NC, C, H, K)
    lg = torch.nn.functional.pad(log_gamma.to(acc), (0, 0, 0, pad)).view(B, NC, C, H)
    kh = kap.permute(0, 3, 1, 2, 4)  # [B, H, NC, C, K]
    b = lg.permute(0, 3, 1, 2).cumsum(-1)  # [B, H, NC, C]: log decay from the chunk start to t
    causal = torch.ones(C, C, dtype=torch.bool, device=kappa.device).tril()
    D = (b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [B, H, NC, C, C]
    m_local, n_local = D @ kh, D.sum(-1)
    # Sums entering chunk c: L[c, c'] = decay from the end of chunk c' to the start of chunk c (c' < c).
    ends = b[..., -1].cumsum(-1)  # [B, H, NC]: log decay from position 0 to the end of chunk c
    starts = ends - b[..., -1]  # ... to the start of chunk c
    strict = torch.ones(NC, NC, dtype=torch.bool, device=kappa.device).tril(-1)
    L = (starts.unsqueeze(-1) - ends.unsqueeze(-2)).masked_fill(~strict, float("-inf")).exp()
    carry0 = starts.exp()  # decay of the initial state to each chunk start
    m_in = L @ m_local[..., -1, :] + carry0.unsqueeze(-1) * state.m.unsqueeze(2)  # [B, H, NC, K]
    n_in = (L @ n_local[..., -1].unsqueeze(-1)).squeeze(-1) + carry0 * state.n.unsqueeze(-1)  # [B, H, NC]
    into = b.exp()  # decay from the chunk start to t
    m = m_local + into.unsqueeze(-1) * m_in.unsqueeze(-2)
    n = n_local + into * n_in.unsqueeze(-1)
    return m.reshape(B, H, NC * C, K)[:, :, :T], n.reshape(B, H, NC * C)[:, :, :T]


def _ccq_chunk_kernel(r, kappa, log_gamma, lam, order, centered, state: CCQState, chunk_size: int,
                      from_zero: bool, form: str = "series"):
    """The kernel path (CUDA): each order is one scalar-decay linear attention pass (q = u, k = v = kappa,
    scale 1), fla's chunk_simple_gla on CUDA; m and n come from `decayed_sums`. Device-agnostic through
    the backend's dispatch, so CPU tests check it (and its gradients) against the reference in fp64."""
    from ccq_eval.model.fla_cpu import chunk_simple_gla

    acc = state.P.dtype
    m, n = decayed_sums(kappa, log_gamma, state, chunk_size)
    mu = (m / n.unsqueeze(-1)).permute(0, 2, 1, 3)  # [B, T, H, K]
    inv_n = (1.0 / n).permute(0, 2, 1).unsqueeze(-1)  # [B, T, H, 1]
    kap = kappa.to(r.dtype)
    g = log_gamma.float() if r.dtype != torch.float64 else log_gamma
    # A zero initial state is skipped: no state read in the kernel, and no state gradient to form.
    P0 = None if from_zero else state.P.to(torch.float32 if r.dtype != torch.float64 else acc)
    final_P = state.P

    def sigma_times(u):
        nonlocal final_P
        Pu, final_P = chunk_simple_gla(
            q=u.to(r.dtype), k=kap, v=kap, g=g, scale=1.0, initial_state=P0, output_final_state=True,
        )
        out = Pu.to(acc) * inv_n
        if centered:
            out = out - mu * (mu * u).sum(-1, keepdim=True)
        return out

    q = apply_read_form(form, r.to(acc), lam.to(acc).unsqueeze(-1), order, sigma_times)
    return q.to(r.dtype), CCQState(final_P.to(acc), m[:, :, -1], n[:, :, -1])




def _ccq_order1_fused(r, kappa, log_gamma, lam, centered, initial_state):
    """The fused path (where `_fused_applies`) for any call without gradients (scoring, prefill with a
    cached state) and training calls from a zero state, else None: a gradient through an initial state
    is left to the unfused path."""
    from ccq_eval.model.kernels.ccq_forward import ccq_order1_forward

    if not _needs_grad(r, kappa, log_gamma, lam):
        q, final = ccq_order1_forward(r, kappa, log_gamma, lam, centered, initial_state, output_final_state=True)
        return q, CCQState(*final)
    if initial_state is None:
        q, P, m, n = _FusedOrder1.apply(r, kappa, log_gamma, lam, centered)
        return q, CCQState(P, m, n)
    return None


def ccq_read_chunk(
    r: torch.Tensor,
    kappa: torch.Tensor,
    log_gamma: torch.Tensor,
    lam: torch.Tensor,
    order: int = 1,
    centered: bool = True,
    initial_state: CCQState | None = None,
    chunk_size: int = 64,
    *,
    form: str = "series",
) -> tuple[torch.Tensor, CCQState]:
    """Chunkwise form for training, scoring and prefill. Dispatches on the tensors' device."""
    _check(r, kappa, log_gamma, lam, order, form)
    B, _, H, K = r.shape
    acc = _state_dtype(r)
    if _fused_applies(r, order, form):
        fused = _ccq_order1_fused(r, kappa, log_gamma, lam, centered, initial_state)
        if fused is not None:
            return fused
    state = zero_state(B, H, K, r.device, acc) if initial_state is None else CCQState(
        *(s.to(acc) for s in initial_state)
    )
    if r.is_cuda and r.dtype != torch.float64:
        return _ccq_chunk_kernel(r, kappa, log_gamma, lam, order, centered, state, chunk_size,
                                 from_zero=initial_state is None, form=form)
    return _ccq_chunk_torch(r, kappa, log_gamma, lam, order, centered, state, chunk_size, form)


class CCQGate(NamedTuple):
    """lambda_t = lam_max * sigmoid(a_h . r_t + b_h) (query gate) or lam_max * sigmoid(b_h) (weight None)."""

    weight: torch.Tensor | None  # a [H, K]
    bias: torch.Tensor  # b [H]
    lam_max: float

    def values(self, r: torch.Tensor) -> torch.Tensor:
        """lambda [B, T, H] in fp32 for queries r [B, T, H, K]."""
        bias = self.bias.float()
        if self.weight is None:
            return (self.lam_max * torch.sigmoid(bias)).expand(r.shape[:3])
        return self.lam_max * torch.sigmoid((r.float() * self.weight.float()).sum(-1) + bias)


def ccq_read_keys(r, k, log_gamma, gate: CCQGate, order=1, centered=True, initial_state=None,
                  keys_unit: bool = False, form: str = "series"):
    """What a layer calls, with its raw keys k and its gate. On CUDA with the fused kernels (series order 1)
    the kernels normalise the keys and form lambda themselves: for inference, the chunked read for
    prefill and scoring and a one-step kernel for decoding; for training from a zero state,
    _FusedOrder1Keys. Everything else forms unit_keys(k) and lambda here and calls ccq_read.
    keys_unit: k is already L2-normalised (Gated DeltaNet's l2norm; docs/operator.md: its keys are unit
    already), so the fused chunked read takes it as kappa and skips its normalising pass. The other
    paths normalise it again, which changes it by rounding, and for keys fla's l2norm leaves shorter
    than unit (its eps = 1e-6 is added to ||k||^2, so below ||k|| ~ 1e-3) by their length.
    form: "series" or "resolvent" (order is then the number of CG steps); the resolvent always takes
    the unfused paths."""
    inputs = (r, k, log_gamma, gate.bias) + (() if gate.weight is None else (gate.weight,))
    B, T, H, K = r.shape
    fused_domain = _fused_applies(r, order, form)
    if fused_domain and _needs_grad(*inputs) and initial_state is None and T > 1:
        _check(r, k, log_gamma, log_gamma, order)
        q, P, m, n = _FusedOrder1Keys.apply(r, k, log_gamma, gate.weight, gate.bias, gate.lam_max, centered)
        return q, CCQState(P, m, n)  # training from a zero state
    fused = fused_domain and not _needs_grad(*inputs)
    if fused:
        fused = T > 1 or K & (K - 1) == 0  # the decoding kernel needs a power-of-two head dim
    if not fused:
        return ccq_read(r, unit_keys(k), log_gamma, gate.values(r), order, centered, initial_state, form=form)
    from ccq_eval.model.kernels.ccq_decode import ccq_order1_decode
    from ccq_eval.model.kernels.ccq_forward import ccq_order1_forward

    _check(r, k, log_gamma, log_gamma, order)  # lam has log_gamma's shape; the kernels form it
    if T == 1:
        state = zero_state(B, H, K, r.device) if initial_state is None else initial_state
        q, new_state = ccq_order1_decode(r, k, log_gamma, gate, state, centered)
        return q, CCQState(*new_state)
    q, final = ccq_order1_forward(r, k, log_gamma, None, centered, initial_state, output_final_state=True,
                                  raw_keys=not keys_unit, gate=gate)
    return q, CCQState(*final)


def ccq_read(r, kappa, log_gamma, lam, order=1, centered=True, initial_state=None, *, form="series"):
    """What a layer calls: the recurrence for one-token decode steps, the chunk form otherwise."""
    if r.shape[1] == 1:
        return ccq_read_recurrent(r, kappa, log_gamma, lam, order, centered, initial_state, form=form)
    return ccq_read_chunk(r, kappa, log_gamma, lam, order, centered, initial_state, form=form)
