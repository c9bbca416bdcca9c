"""The hand-derived order-1 CCQ backward matches autograd through the O(T^2) reference."""

import pytest
import torch

from ccq_eval.ccq import ccq_read_reference, unit_keys
from ccq_eval.ccq_backward import ccq_order1_backward


def _inputs(B=2, T=150, H=3, K=16, seed=0, dtype=torch.float64, no_decay=False):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    kappa = unit_keys(torch.randn(B, T, H, K, generator=g, dtype=dtype))
    # gamma in (0, 1), spread from strong to weak decay so both the in-chunk and carried terms matter
    log_gamma = torch.nn.functional.logsigmoid(2 * torch.randn(B, T, H, generator=g, dtype=dtype) + 3)
    if no_decay:
        log_gamma = torch.zeros_like(log_gamma)
    lam = 4.0 * torch.rand(B, T, H, generator=g, dtype=dtype)
    dq = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    return r, kappa, log_gamma, lam, dq


def _autograd_grads(r, kappa, log_gamma, lam, dq, centered):
    leaves = [x.detach().clone().requires_grad_(True) for x in (r, kappa, log_gamma, lam)]
    q, _ = ccq_read_reference(*leaves, order=1, centered=centered)
    return torch.autograd.grad((q * dq).sum(), leaves)


NAMES = ("dr", "dkappa", "dlog_gamma", "dlam")


@pytest.mark.parametrize("centered", [True, False])
@pytest.mark.parametrize(
    "T, chunk_size",
    [(150, 32), (20, 32), (128, 32), (1, 16)],
    ids=["T_not_multiple", "T_below_one_chunk", "T_multiple", "T_one"],
)
def test_matches_autograd_fp64(centered, T, chunk_size):
    r, kappa, log_gamma, lam, dq = _inputs(T=T)
    expected = _autograd_grads(r, kappa, log_gamma, lam, dq, centered)
    got = ccq_order1_backward(r, kappa, log_gamma, lam, dq, centered=centered, chunk_size=chunk_size)
    for name, g, e in zip(NAMES, got, expected):
        assert g.dtype == torch.float64 and g.shape == e.shape, name
        # atol for the entries that are 0 in exact arithmetic (dlog_gamma at t = 0: w only sees
        # differences of c) and come out as rounding noise in both.
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("centered", [True, False])
def test_matches_autograd_without_decay_fp64(centered):
    r, kappa, log_gamma, lam, dq = _inputs(T=150, no_decay=True)
    expected = _autograd_grads(r, kappa, log_gamma, lam, dq, centered)
    got = ccq_order1_backward(r, kappa, log_gamma, lam, dq, centered=centered, chunk_size=32)
    for name, g, e in zip(NAMES, got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9, msg=name)


def test_chunk_size_does_not_change_the_result():
    r, kappa, log_gamma, lam, dq = _inputs(T=150)
    a = ccq_order1_backward(r, kappa, log_gamma, lam, dq, chunk_size=16)
    b = ccq_order1_backward(r, kappa, log_gamma, lam, dq, chunk_size=64)
    for name, x, y in zip(NAMES, a, b):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("centered", [True, False])
def test_fp32_inputs_give_fp32_close_to_fp64(centered):
    r, kappa, log_gamma, lam, dq = _inputs(T=300)
    exact = ccq_order1_backward(r, kappa, log_gamma, lam, dq, centered=centered, chunk_size=64)
    got = ccq_order1_backward(*(x.float() for x in (r, kappa, log_gamma, lam, dq)), centered=centered,
                              chunk_size=64)
    for name, g, e in zip(NAMES, got, exact):
        assert g.dtype == torch.float32, name
        # fp32 rounding of O(1) per-position terms; dlog_gamma is a reverse cumulative sum over
        # T = 300 positions, so it is measured against its own scale.
        scale = e.abs().max().item()
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5 * scale, msg=name)
