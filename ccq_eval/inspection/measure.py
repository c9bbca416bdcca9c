"""Per layer and head of one prompt: the gate, the key covariance, the query's move and the needle share.

Definitions (the README's "Looking inside" states them too):
- CCQ on / off on the same weights. A CCQ model: on = its read as trained (q~), off = the same state
  read with r instead of q~. A baseline: off = its read as is (r), on = the read with
  q~ = sum_j (-lambda Sigma_t)^j r from a constant lambda (`baseline_lambda`: by default
  ccq_lambda_max * sigmoid(ccq_gate_bias_init) of its config, 2.0 for the defaults, the value an
  attached gate starts at) and the config's decay, centering, read form and order (ccq_form
  "resolvent": its ccq_solve_steps CG steps, as a layer runs them). The state is the same either
  way: CCQ changes only the read.
- lambda_t: a CCQ model's gate, lambda_max sigmoid(a . r_t + b); for a baseline the constant above
  (column lambda_source says which).
- Sigma_t: the decayed covariance of the unit keys (docs/operator.md), at the answer position; its
  eigenvalues, trace, effective rank (tr Sigma)^2 / tr Sigma^2 and participation ratio
  effective rank / d_k; needle_top_energy / haystack_top_energy: the mean squared projection of
  the needle's / the other tokens' unit keys on Sigma's top-16 eigen-directions.
- q_move = ||q~ - r|| / ||r||, q_cos = cos(q~, r), q_norm_ratio = ||q~|| / ||r||; q_move_mean: over
  every position (CCQ models) or the sampled ones (baselines, whose q~ is computed there only).
- Needle share of the read at the answer position t (the last prompt token): the read is
  o_t = sum_{i<=t} c_i v_i with one scalar weight c_i per token (reads.py gives c for GLA and
  Gated DeltaNet); needle_share = sum_{i in needle} ||c_i v_i|| / sum_{i<=t} ||c_i v_i||;
  value_share: the same over the needle's value tokens only; needle_token_fraction: the needle's
  share of the tokens, what a read spread evenly would give. distractor_share (tasks with competing
  needles: RULER's multi-key NIAH): the same sum over every distractor needle's tokens (needles under
  keys the question does not ask), distractor_token_fraction their share of the tokens, and
  distractors their count; NaN where a prompt has none. CCQ's claim is that the read moves from the
  bulk of stored vectors toward the asked needle: needle_share up, distractor_share down.
- read_residual: ||sum_i c_i v_i - o_t|| / ||o_t|| for the read the model ran (CCQ models: on,
  baselines: off) against the kernel's own output; ccq_residual: the captured q~ against the one
  rebuilt from Sigma_t (CCQ models). Both near rounding when the decomposition is right.
"""

from __future__ import annotations

import math

import torch

from ccq_eval.inspection.prompts import NeedlePrompt
from ccq_eval.inspection.reads import (
    LayerRead,
    ccq_query_from_sigma,
    decayed_moments,
    key_covariance,
    read_from_weights,
    read_weights,
    token_shares,
)
from ccq_eval.model.ccq import sigma_passes, unit_keys

TOP_DIRECTIONS = 16
TOP_EIGENVALUES = 4


class CCQSettings:
    """The CCQ read a layer uses (a CCQ model) or would use (a baseline): from the model's config."""

    def __init__(self, config, baseline_lambda: float | None = None):
        self.centered = bool(getattr(config, "ccq_centered", True))
        self.decay = getattr(config, "ccq_decay", "state")
        self.form = getattr(config, "ccq_form", "series")
        self.order = sigma_passes(self.form, int(getattr(config, "ccq_order", 1)),
                                  int(getattr(config, "ccq_solve_steps", 4)))
        lam_max = float(getattr(config, "ccq_lambda_max", 4.0))
        bias = float(getattr(config, "ccq_gate_bias_init", 0.0))
        default = lam_max / (1.0 + math.exp(-bias))  # the gate's initial lambda
        self.baseline_lambda = default if baseline_lambda is None else float(baseline_lambda)


def ccq_scalar_log_decay(read: LayerRead, settings: CCQSettings) -> torch.Tensor:
    """CCQ's log gamma [H, T] for a layer: the captured one (CCQ models), else as docs/operator.md defines it."""
    if read.ccq_log_gamma is not None:
        return read.ccq_log_gamma
    if settings.decay == "none":
        return torch.zeros(read.k.shape[:2], dtype=read.k.dtype, device=read.k.device)
    return read.log_decay.mean(-1) if read.family == "gla" else read.log_decay


def sample_positions(length: int, count: int, prompt: NeedlePrompt) -> list[int]:
    """`count` evenly spaced positions, the needle's first and last token and the answer position."""
    last = length - 1
    even = {round(last * i / max(count - 1, 1)) for i in range(count)} if count > 0 else set()
    return sorted(even | {prompt.needle[0], prompt.needle[1] - 1, last})


def _move(q: torch.Tensor, r: torch.Tensor):
    """(||q - r|| / ||r||, cos(q, r), ||q|| / ||r||) over the last axis."""
    r_norm = r.norm(dim=-1).clamp_min(1e-30)
    return ((q - r).norm(dim=-1) / r_norm,
            (q * r).sum(-1) / (q.norm(dim=-1).clamp_min(1e-30) * r_norm),
            q.norm(dim=-1) / r_norm)


def _distractor_columns(shares: torch.Tensor, in_distractor: torch.Tensor, count: int, tokens: int) -> dict:
    """Read share (on, off) and token share of the distractor needles; NaN without distractors."""
    if count == 0:
        return {"distractors": 0, "distractor_share_on": math.nan, "distractor_share_off": math.nan,
                "distractor_token_fraction": math.nan}
    return {"distractors": count, "distractor_share_on": shares[0, in_distractor].sum(),
            "distractor_share_off": shares[1, in_distractor].sum(),
            "distractor_token_fraction": in_distractor.sum() / tokens}


def _spectrum(sigma: torch.Tensor, kappa: torch.Tensor):
    """(Sigma's eigenvalues [H, K] at the answer position (the last of sigma's positions), descending;
    the effective rank [H, P] at every position; each token's energy [H, t+1] on the answer position's top
    TOP_DIRECTIONS eigen-directions) for sigma [H, P, K, K] and the unit keys kappa [H, t+1, K]."""
    eigenvalues, eigenvectors = torch.linalg.eigh(sigma)  # ascending
    positive = eigenvalues.clamp_min(0)
    eff_rank = positive.sum(-1) ** 2 / positive.square().sum(-1).clamp_min(1e-30)
    top = eigenvectors[:, -1, :, -min(TOP_DIRECTIONS, sigma.shape[-1]):]  # [H, K, TOP_DIRECTIONS]
    return eigenvalues[:, -1].flip(-1).clamp_min(0.0), eff_rank, ((kappa @ top) ** 2).sum(-1)


def _token_masks(prompt: NeedlePrompt, tokens: int, device: torch.device):
    """Boolean masks over the prompt's first `tokens` tokens: (the needle, its value, every distractor)."""
    in_needle = torch.zeros(tokens, dtype=torch.bool, device=device)
    in_needle[prompt.needle[0] : prompt.needle[1]] = True
    in_value = torch.zeros_like(in_needle)
    in_value[prompt.value[0] : prompt.value[1]] = True
    in_distractor = torch.zeros_like(in_needle)
    for start, end in prompt.distractors:
        in_distractor[start:end] = True
    return in_needle, in_value, in_distractor


def measure_layer(read: LayerRead, prompt: NeedlePrompt, settings: CCQSettings, positions: list[int]):
    """(rows, spectrum rows, position rows) for one layer of one prompt; rows are dicts per head."""
    t = prompt.answer_position
    trained = read.ccq_query is not None
    r = read.r if trained else read.q  # the query before CCQ
    kappa = unit_keys(read.ccq_keys if trained else read.k)
    log_gamma = ccq_scalar_log_decay(read, settings)
    H, T, K = r.shape
    if t != T - 1:
        raise ValueError(f"the captured read covers {T} tokens, the prompt {t + 1}")

    n, m, second = decayed_moments(kappa, log_gamma, positions)
    sigma = key_covariance(n, m, second, settings.centered)  # [H, P, K, K]
    r_at = r[:, positions]  # [H, P, K]
    if trained:
        lam_all = read.lam
        q_at = read.ccq_query[:, positions]
    else:
        lam_all = torch.full((H, T), settings.baseline_lambda, dtype=r.dtype, device=r.device)
        q_at = ccq_query_from_sigma(sigma, r_at, lam_all[:, positions], settings.order, settings.form)
    lam_at = lam_all[:, positions]
    move, cos, ratio = _move(q_at, r_at)
    rebuilt = ccq_query_from_sigma(sigma, r_at, lam_at, settings.order, settings.form)
    ccq_residual = ((rebuilt - q_at).norm(dim=-1) / q_at.norm(dim=-1).clamp_min(1e-30))[:, -1]

    spectrum, eff_rank_all, energy = _spectrum(sigma, kappa[:, : t + 1])
    trace = spectrum.sum(-1)
    in_needle, in_value, in_distractor = _token_masks(prompt, t + 1, r.device)

    # The read at t with both queries; the one the model ran is checked against the kernel's output.
    q_on, q_off = q_at[:, -1], r_at[:, -1]
    weights = read_weights(read, torch.stack([q_on, q_off]), t)  # [2, H, t+1]
    shares = token_shares(weights, read.v.unsqueeze(0))
    ran = weights[0] if trained else weights[1]
    rebuilt_read = read_from_weights(ran, read.v)
    actual = read.output[:, t]
    read_residual = (rebuilt_read - actual).norm(dim=-1) / actual.norm(dim=-1).clamp_min(1e-30)

    lam_q = torch.quantile(lam_all.float(), torch.tensor([0.1, 0.5, 0.9], device=r.device), dim=-1)
    all_move = _move(read.ccq_query, r)[0].mean(-1) if trained else move.mean(-1)
    rows, spectra, samples = [], [], []
    for h in range(H):
        row = {
            "head": h, "lambda_source": "gate" if trained else "constant",
            "lambda_answer": lam_at[h, -1], "lambda_mean": lam_all[h].mean(), "lambda_p10": lam_q[0, h],
            "lambda_p50": lam_q[1, h], "lambda_p90": lam_q[2, h],
            "q_move_answer": move[h, -1], "q_cos_answer": cos[h, -1], "q_norm_ratio_answer": ratio[h, -1],
            "q_move_mean": all_move[h],
            "sigma_trace": trace[h], "sigma_eff_rank": eff_rank_all[h, -1],
            "sigma_participation": eff_rank_all[h, -1] / K,
            **{f"sigma_eig_{j + 1}": spectrum[h, j] for j in range(min(TOP_EIGENVALUES, K))},
            "needle_top_energy": energy[h, in_needle].mean(), "haystack_top_energy": energy[h, ~in_needle].mean(),
            "needle_share_on": shares[0, h, in_needle].sum(), "needle_share_off": shares[1, h, in_needle].sum(),
            "value_share_on": shares[0, h, in_value].sum(), "value_share_off": shares[1, h, in_value].sum(),
            "needle_token_fraction": in_needle.sum() / (t + 1),
            **_distractor_columns(shares[:, h], in_distractor, len(prompt.distractors), t + 1),
            "read_residual": read_residual[h], "ccq_residual": ccq_residual[h] if trained else math.nan,
        }
        rows.append({key: (float(value) if torch.is_tensor(value) else value) for key, value in row.items()})
        spectra.extend({"head": h, "rank": j + 1, "eigenvalue": float(spectrum[h, j])} for j in range(K))
        for index, position in enumerate(positions):
            samples.append({
                "head": h, "position": position,
                "in_needle": bool(prompt.needle[0] <= position < prompt.needle[1]),
                "lambda": float(lam_at[h, index]), "q_move": float(move[h, index]), "q_cos": float(cos[h, index]),
                "sigma_eff_rank": float(eff_rank_all[h, index]),
            })
    return rows, spectra, samples
