"""Hand-derived backward of the CCQ read, order 1, zero initial state (the operator of
`ccq.ccq_read_reference`), vectorised over chunks like `ccq.decayed_sums`.

Forward, per batch b, head h, with c_t = sum_{j<=t} log_gamma_j and w_{i,t} = exp(c_t - c_i), i <= t:
    n_t = sum_i w_{i,t},  m_t = sum_i w_{i,t} kappa_i,  Pu_t = P_t r_t = sum_i w_{i,t} kappa_i (kappa_i . r_t)
    mu_t = m_t / n_t,  alpha_t = mu_t . r_t
    s_t = Pu_t / n_t - mu_t alpha_t  (centered)   or   Pu_t / n_t  (uncentered)
    q_t = r_t - lam_t s_t

Backward of sum(q * dq), per position (all local):
    ds = -lam dq,  dlam = -(dq . s),  dPu = ds / n,  dn = -(ds . Pu) / n^2
    centered: dalpha = -(mu . ds),  dmu = -alpha ds + dalpha r,  dr += dalpha mu,
              dm = dmu / n,  dn += -(dmu . m) / n^2;       uncentered: dm = 0
then through the decayed sums (P is symmetric, so P^T dPu = P dPu):
    dr_t     = dq_t + [centered term] + P_t dPu_t                                     (causal)
    dkappa_i = Q_i kappa_i + g_i,  Q_i = sum_{t>=i} w_{i,t} (dPu_t r_t^T + r_t dPu_t^T),
               g_i = sum_{t>=i} w_{i,t} dm_t                                          (anti-causal)
    dc_t     = X_t - Y_t: w_{i,t} depends on c_t with sign + (t the later end) and on c_i with sign -
               X_t = dPu_t . Pu_t + m_t . dm_t + n_t dn_t
               Y_t = sum_{t'>=t} w_{t,t'} [(kappa_t . r_t')(kappa_t . dPu_t') + kappa_t . dm_t' + dn_t']
                   = kappa_t . (Q_t kappa_t / 2 + g_t) + h_t,  h_t = sum_{t'>=t} w_{t,t'} dn_t'
    dlog_gamma_j = sum_{t>=j} dc_t

Every decayed sum splits into a dense C x C part inside the chunk and a part carried across chunks as a
K x K (or K, or scalar) state per chunk, combined by an NC x NC matrix of chunk-to-chunk decays. The
factorisation w_{i,t} = exp(b_end - b_i) * exp(start_c' - end_c) * exp(b_t) only uses factors <= 1
(for log_gamma <= 0), so nothing overflows, and w underflows only where a factor does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ccq_order1_backward(r, kappa, log_gamma, lam, dq, centered: bool = True, chunk_size: int = 64):
    """returns (dr, dkappa, dlog_gamma, dlam): gradients of sum(q * dq) w.r.t. the four inputs

    q = ccq_read_reference(r, kappa, log_gamma, lam, order=1, centered=centered)[0] (zero initial
    state); kappa is an independent input (its unit normalisation is outside). Shapes: r, kappa, dq
    [B, T, H, K]; log_gamma, lam [B, T, H]. Computed in fp32 (fp64 for fp64 r), a fixed number of
    batched ops whatever T is; each gradient is returned in its input's dtype.
    """
    B, T, H, K = r.shape
    acc = torch.float64 if r.dtype == torch.float64 else torch.float32
    C = chunk_size
    NC = -(-T // C)
    pad = NC * C - T

    def chunked(x):
        # [B, T, H, *] -> [B, H, NC, C, *]. Padded steps (zero key, r, dq, lam and log decay) sit after
        # the last real position: causal sums never see them, and their zero dq makes every cotangent
        # there zero, so the anti-causal sums do not either (n >= 1 there, so no 0/0).
        x = F.pad(x.to(acc), (0, 0) * (x.dim() - 2) + (0, pad))
        return x.view(B, NC, C, H, *x.shape[3:]).movedim(3, 1)

    def unchunked(x):
        # [B, H, NC, C, *] -> [B, T, H, *], padding cut off.
        return x.reshape(B, H, NC * C, *x.shape[4:])[:, :, :T].movedim(1, 2)

    rh, kh, dqh = chunked(r), chunked(kappa), chunked(dq)  # [B, H, NC, C, K]
    lam_h = chunked(lam).unsqueeze(-1)  # [B, H, NC, C, 1]
    b = chunked(log_gamma).cumsum(-1)  # [B, H, NC, C]: log decay from the chunk start to t

    # --- decays --------------------------------------------------------------------------------------
    causal = torch.ones(C, C, dtype=torch.bool, device=r.device).tril()
    # D[.., t, i] = exp(b_t - b_i) = w_{i,t} for i <= t in the same chunk
    D = (b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [B, H, NC, C, C]
    Dt = D.transpose(-1, -2)  # Dt[.., i, t]: the anti-causal view of the same weights
    into = b.exp()  # [B, H, NC, C]: decay from the chunk start to t
    out = (b[..., -1:] - b).exp()  # decay from i to the chunk end
    ends = b[..., -1].cumsum(-1)  # [B, H, NC]: log decay from position 0 to the end of chunk c
    starts = ends - b[..., -1]
    strict = torch.ones(NC, NC, dtype=torch.bool, device=r.device).tril(-1)
    # L[c, c'] = decay from the end of chunk c' to the start of chunk c (c' < c); L^T carries backwards.
    L = (starts.unsqueeze(-1) - ends.unsqueeze(-2)).masked_fill(~strict, float("-inf")).exp()
    Lt = L.transpose(-1, -2)

    def across(local_per_chunk, carry):
        # Apply an NC x NC chunk decay matrix to per-chunk states of any trailing shape.
        flat = local_per_chunk.reshape(B, H, NC, -1)
        return (carry @ flat).view(local_per_chunk.shape)

    # --- forward sums (recomputed: n, m, and the K x K state P entering each chunk) ---------------------
    n_local, m_local = D.sum(-1), D @ kh
    n = n_local + into * across(n_local[..., -1], L).unsqueeze(-1)
    m = m_local + into.unsqueeze(-1) * across(m_local[..., -1, :], L).unsqueeze(-2)
    # P_in[c] = sum over earlier chunks of decayed kappa kappa^T, at the start of chunk c
    P_in = across((out.unsqueeze(-1) * kh).transpose(-1, -2) @ kh, L)  # [B, H, NC, K, K]

    def times_P(u):
        # P_t u_t = sum_{i<=t} w_{i,t} kappa_i (kappa_i . u_t) for u [B, H, NC, C, K]; P_in is
        # symmetric, so the row form u @ P_in is P_in u.
        return (D * (u @ kh.transpose(-1, -2))) @ kh + into.unsqueeze(-1) * (u @ P_in)

    Pu = times_P(rh)
    inv_n = (1.0 / n).unsqueeze(-1)
    mu = m * inv_n
    alpha = (mu * rh).sum(-1, keepdim=True)
    s = Pu * inv_n - mu * alpha if centered else Pu * inv_n

    # --- local cotangents ----------------------------------------------------------------------------
    ds = -lam_h * dqh
    dlam = -(dqh * s).sum(-1)
    dPu = ds * inv_n
    dn = -(ds * Pu).sum(-1) * inv_n.squeeze(-1) ** 2
    dr = dqh + times_P(dPu)
    if centered:
        dalpha = -(mu * ds).sum(-1, keepdim=True)
        dmu = -alpha * ds + dalpha * rh
        dr = dr + dalpha * mu
        dm = dmu * inv_n
        dn = dn - (dmu * m).sum(-1) * inv_n.squeeze(-1) ** 2
    else:
        dm = torch.zeros_like(m)
    del P_in

    # --- anti-causal sums over t >= i: Q_i kappa_i, g_i, h_i -----------------------------------------
    # Inside the chunk: sum_t Dt[i, t] [(kappa_i . r_t) dPu_t + (kappa_i . dPu_t) r_t], dense.
    Qk = (Dt * (kh @ rh.transpose(-1, -2))) @ dPu + (Dt * (kh @ dPu.transpose(-1, -2))) @ rh
    g = Dt @ dm
    h = (Dt @ dn.unsqueeze(-1)).squeeze(-1)
    # From later chunks: their sums decayed to their own start, carried back by L^T to the end of chunk
    # c, then decayed from there to i by `out`. Q is symmetric, so kappa @ Q = Q kappa.
    Q_start = (into.unsqueeze(-1) * dPu).transpose(-1, -2) @ rh
    Q_start = Q_start + Q_start.transpose(-1, -2)  # sum_t into_t (dPu_t r_t^T + r_t dPu_t^T)
    Q_later = across(Q_start, Lt)  # [B, H, NC, K, K]
    del Q_start
    out_ = out.unsqueeze(-1)
    Qk = Qk + out_ * (kh @ Q_later)
    del Q_later
    g = g + out_ * across((into.unsqueeze(-1) * dm).sum(-2), Lt).unsqueeze(-2)
    h = h + out * across((into * dn).sum(-1), Lt).unsqueeze(-1)

    dkappa = Qk + g
    # (kappa . r)(kappa . dPu) = kappa^T (dPu r^T + r dPu^T) kappa / 2, hence the half.
    Y = (kh * (0.5 * Qk + g)).sum(-1) + h
    X = (dPu * Pu).sum(-1) + (m * dm).sum(-1) + n * dn
    dc = unchunked(X - Y)  # [B, T, H]
    dlog_gamma = dc.flip(1).cumsum(1).flip(1)  # dlog_gamma_j = sum_{t>=j} dc_t

    return (
        unchunked(dr).to(r.dtype),
        unchunked(dkappa).to(kappa.dtype),
        dlog_gamma.to(log_gamma.dtype),
        unchunked(dlam).to(lam.dtype),
    )
