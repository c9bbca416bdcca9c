"""The two CCQ read forms: what is done with each application of Sigma (docs/operator.md).

    q~_t = sum_{j=0..R} (-lambda_t Sigma_t)^j r_t          form "series" (R = ccq_order)
    q~_t ~= (I + lambda_t Sigma_t)^-1 r_t                   form "resolvent" (S = ccq_solve_steps)

The resolvent is solved by S conjugate-gradient steps from q~ = 0: I + lambda Sigma is symmetric
positive definite, every position solves its own K x K system with its own step scalars, all positions
at once, and each step applies Sigma once, as each series order does. `order` below is that count of
Sigma applications for either form. Why CG: its iterates grow in norm towards the solution (Steihaug),
so ||q~|| <= ||(I + lambda Sigma)^-1 r|| <= ||r|| after any number of steps (the resolvent never
expands the query, whatever lambda); it is exact after at most K steps (in exact arithmetic); and
since 0 <= Sigma <= I the condition number is at most c = 1 + lambda, so the error in the
(I + lambda Sigma)-norm is at most 2 ((sqrt(c) - 1) / (sqrt(c) + 1))^S times the solution's. The
series (a truncated Neumann series) diverges as R grows once lambda s_max > 1.

Both take sigma_times(u) = Sigma u and are indifferent to how it is formed, so every form of the
operator in `ccq` (reference, chunkwise, recurrent, kernel paths) reads with either.
"""

from __future__ import annotations

import torch


def _polynomial(r: torch.Tensor, lam: torch.Tensor, order: int, sigma_times) -> torch.Tensor:
    """q~ = sum_{j=0..R} (-lam Sigma)^j r, one application of Sigma per order."""
    term, total = r, r
    for _ in range(order):
        term = -lam * sigma_times(term)
        total = total + term
    return total


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1, keepdim=True)


def _ratio_or_zero(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den > 0, else 0 (a position whose residual is exactly zero takes no further
    step); the masked division keeps 0/0 out of the gradient too."""
    positive = den > 0
    quotient = num / torch.where(positive, den, torch.ones_like(den))
    return torch.where(positive, quotient, torch.zeros_like(num))


def _resolvent(r: torch.Tensor, lam: torch.Tensor, steps: int, sigma_times) -> torch.Tensor:
    """q~ ~= (I + lam Sigma)^-1 r: `steps` conjugate-gradient iterations from q~ = 0, one application of
    Sigma per iteration, with per-position step scalars (dot products over the last dim). d.Ad is
    formed as ||d||^2 + lam (d . Sigma d): at lam = 0 the first step is alpha = 1 exactly, so q~ = r
    bit for bit, and d.Ad >= ||d||^2 > 0 even where rounding leaves Sigma slightly indefinite."""
    solution = torch.zeros_like(r)
    residual, direction = r, r
    residual_sq = _dot(r, r)
    for step in range(steps):
        sigma_d = sigma_times(direction)
        alpha = _ratio_or_zero(residual_sq, _dot(direction, direction) + lam * _dot(direction, sigma_d))
        solution = solution + alpha * direction
        if step == steps - 1:
            break
        residual = residual - alpha * (direction + lam * sigma_d)
        next_sq = _dot(residual, residual)
        direction = residual + _ratio_or_zero(next_sq, residual_sq) * direction
        residual_sq = next_sq
    return solution


CCQ_FORMS = ("series", "resolvent")
_READ_FORMS = {"series": _polynomial, "resolvent": _resolvent}


def sigma_passes(form: str, order: int, solve_steps: int) -> int:
    """Sigma applications of one read: the series order, or the resolvent's conjugate-gradient steps
    (the count apply_read_form takes as `order`)."""
    return solve_steps if form == "resolvent" else order


def apply_read_form(form: str, r: torch.Tensor, lam: torch.Tensor, order: int, sigma_times) -> torch.Tensor:
    """q~ from r by the read form ("series" of order `order`, or "resolvent" by `order` CG steps), given
    sigma_times(u) = Sigma u for tensors shaped like r and lam shaped [..., 1]. Public so that code
    holding an explicit Sigma (diagnostics) computes exactly the q~ a model reads with."""
    return _READ_FORMS[form](r, lam, order, sigma_times)
