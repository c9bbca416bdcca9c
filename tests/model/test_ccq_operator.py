"""The three CCQ forms agree, and the operator has the properties docs/operator.md pins."""

import pytest
import torch

from ccq_eval.model.ccq import (
    CCQState,
    _ccq_chunk_kernel,
    ccq_read_chunk,
    ccq_read_recurrent,
    ccq_read_reference,
    unit_keys,
)


def _inputs(B=2, T=150, H=3, K=8, seed=0, dtype=torch.float64, lam_max=4.0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    kappa = unit_keys(torch.randn(B, T, H, K, generator=g, dtype=dtype))
    log_gamma = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=g, dtype=dtype) + 3)
    lam = lam_max * torch.rand(B, T, H, generator=g, dtype=dtype)
    return r, kappa, log_gamma, lam


def _random_state(B, H, K, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    keys = unit_keys(torch.randn(B, 20, H, K, generator=g, dtype=dtype))
    # A genuine state: decayed sums of 20 earlier unit keys (keeps Sigma PSD).
    P = torch.einsum("bthk,bthl->bhkl", keys, keys) * 0.7
    return CCQState(P, keys.sum(1) * 0.7, torch.full((B, H), 20 * 0.7, dtype=dtype))


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("centered", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("form", ["series", "resolvent"])  # for the resolvent, order = CG steps
def test_three_forms_agree_fp64(order, centered, with_state, form):
    r, kappa, log_gamma, lam = _inputs()  # T = 150: not a multiple of the chunk size 64
    state = _random_state(2, 3, 8) if with_state else None
    q_ref, s_ref = ccq_read_reference(r, kappa, log_gamma, lam, order, centered, state, form=form)
    q_chunk, s_chunk = ccq_read_chunk(r, kappa, log_gamma, lam, order, centered, state, 64, form=form)
    q_rec, s_rec = ccq_read_recurrent(r, kappa, log_gamma, lam, order, centered, state, form=form)
    torch.testing.assert_close(q_chunk, q_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(q_rec, q_ref, rtol=1e-10, atol=1e-10)
    for a, b, c in zip(s_ref, s_chunk, s_rec):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(c, a, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("with_state", [False, True])
def test_kernel_path_matches_reference_values_and_gradients_fp64(order, with_state):
    """The CUDA path's algorithm (one linear-attention pass per order, batched decayed sums for m and
    n) run through the CPU backend: same q~, state and gradients as the O(T^2) reference."""
    r, kappa, log_gamma, lam = _inputs(T=150)
    state = _random_state(2, 3, 8) if with_state else None
    leaves = [x.clone().requires_grad_(True) for x in (r, kappa, log_gamma, lam)]
    q_ref, s_ref = ccq_read_reference(*leaves, order, True, state)
    weights = torch.randn_like(q_ref)
    grads_ref = torch.autograd.grad((q_ref * weights).sum(), leaves)

    leaves = [x.clone().requires_grad_(True) for x in (r, kappa, log_gamma, lam)]
    start = state if with_state else CCQState(*(torch.zeros_like(s) for s in _random_state(2, 3, 8)))
    q_k, s_k = _ccq_chunk_kernel(*leaves, order, True, start, 64, from_zero=not with_state)
    grads_k = torch.autograd.grad((q_k * weights).sum(), leaves)
    torch.testing.assert_close(q_k, q_ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(s_k, s_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads_k, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_reference_matches_explicit_covariance():
    """Independent check of the reference: build Sigma_t from its definition, position by position."""
    r, kappa, log_gamma, lam = _inputs(B=1, T=12, H=1, K=4)
    q_ref, _ = ccq_read_reference(r, kappa, log_gamma, lam, order=2, centered=True)
    gam = log_gamma.exp()[0, :, 0]
    for t in range(12):
        w = torch.tensor([torch.prod(gam[i + 1 : t + 1]).item() for i in range(t + 1)], dtype=torch.float64)
        ks = kappa[0, : t + 1, 0]
        n = w.sum()
        mu = (w[:, None] * ks).sum(0) / n
        M = (w[:, None, None] * ks[:, :, None] * ks[:, None, :]).sum(0) / n
        sigma = M - torch.outer(mu, mu)
        A = -lam[0, t, 0] * sigma
        rt = r[0, t, 0]
        expected = rt + A @ rt + A @ (A @ rt)
        torch.testing.assert_close(q_ref[0, t, 0], expected, rtol=1e-12, atol=1e-12)


def test_split_calls_continue_exactly():
    """Chunked prefill over two calls then decode steps == one call (the state carries everything)."""
    r, kappa, log_gamma, lam = _inputs(T=100)
    q_full, s_full = ccq_read_chunk(r, kappa, log_gamma, lam, 2, True)
    q1, s1 = ccq_read_chunk(r[:, :70], kappa[:, :70], log_gamma[:, :70], lam[:, :70], 2, True)
    q2, s2 = ccq_read_chunk(r[:, 70:97], kappa[:, 70:97], log_gamma[:, 70:97], lam[:, 70:97], 2, True, s1)
    q3, s3 = ccq_read_recurrent(r[:, 97:], kappa[:, 97:], log_gamma[:, 97:], lam[:, 97:], 2, True, s2)
    torch.testing.assert_close(torch.cat([q1, q2, q3], 1), q_full, rtol=1e-10, atol=1e-10)
    for a, b in zip(s3, s_full):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_norm_never_grows_for_order1_lambda_le_2():
    """||q~|| <= ||r|| at every position for R = 1 and lambda_max <= 2 (docs/operator.md, property 2)."""
    for decay_shift, centered in [(3.0, True), (3.0, False), (50.0, True)]:  # 50: gamma = 1 ("none")
        r, kappa, log_gamma, _ = _inputs(T=300, seed=3)
        log_gamma = torch.nn.functional.logsigmoid(torch.randn_like(log_gamma) + decay_shift)
        lam = torch.full_like(log_gamma, 2.0)  # the worst case of lambda_max = 2
        # Crowd the keys into a rank-2 bulk so Sigma has a large top eigenvalue.
        basis = torch.linalg.qr(torch.randn(8, 2, dtype=torch.float64))[0]
        kappa = unit_keys(kappa @ basis @ basis.T + 0.01 * kappa)
        q, _ = ccq_read_chunk(r, kappa, log_gamma, lam, 1, centered)
        assert (q.norm(dim=-1) <= r.norm(dim=-1) * (1 + 1e-12)).all()


@pytest.mark.parametrize("form", ["series", "resolvent"])
def test_direction_orthogonal_to_keys_passes_unchanged(form):
    r, kappa, log_gamma, lam = _inputs(T=50, K=6)
    kappa = kappa.clone()
    kappa[..., 0] = 0  # no stored key has a component along e_0
    kappa = unit_keys(kappa)
    r = torch.zeros_like(r)
    r[..., 0] = 1.0
    q, _ = ccq_read_chunk(r, kappa, log_gamma, lam, 3, True, form=form)
    torch.testing.assert_close(q, r, rtol=0, atol=1e-12)


def test_lambda_zero_is_identity_bit_for_bit():
    r, kappa, log_gamma, lam = _inputs(dtype=torch.float32)
    q, _ = ccq_read_chunk(r, kappa, log_gamma, torch.zeros_like(lam), 2, True)
    assert torch.equal(q, r)


def test_finite_at_20k_tokens_with_defaults():
    """Default lambda_max = 4, order 1, decay close to 1: outputs stay finite over 20K tokens (fp32)."""
    r, kappa, log_gamma, lam = _inputs(B=1, T=20480, H=2, K=16, dtype=torch.float32, lam_max=4.0)
    log_gamma = torch.zeros_like(log_gamma)  # decay "none": the longest memory
    q, state = ccq_read_chunk(r, kappa, log_gamma, lam, 1, True)
    assert torch.isfinite(q).all() and all(torch.isfinite(s).all() for s in state)
    assert state.n[0, 0].item() == pytest.approx(20480, rel=1e-6)


def test_bad_shapes_and_order_are_rejected():
    r, kappa, log_gamma, lam = _inputs(T=10)
    with pytest.raises(ValueError, match="ccq_order"):
        ccq_read_chunk(r, kappa, log_gamma, lam, 0, True)
    with pytest.raises(ValueError, match="log_gamma"):
        ccq_read_chunk(r, kappa, log_gamma[:, :5], lam, 1, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's kernels")
def test_cuda_chunk_matches_reference():
    r, kappa, log_gamma, lam = _inputs(B=1, T=1000, H=4, K=64, dtype=torch.float32)
    state = _random_state(1, 4, 64, dtype=torch.float32)
    q_ref, s_ref = ccq_read_chunk(r, kappa, log_gamma, lam, 2, True, state)  # CPU torch path
    cuda = [x.cuda() for x in (r, kappa, log_gamma, lam)]
    q_gpu, s_gpu = ccq_read_chunk(*cuda, 2, True, CCQState(*(s.cuda() for s in state)))
    torch.testing.assert_close(q_gpu.cpu(), q_ref, rtol=2e-3, atol=2e-3)
    for a, b in zip(s_gpu, s_ref):
        torch.testing.assert_close(a.cpu(), b, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's kernels")
def test_cuda_chunk_gradients_match_cpu():
    """Backward through fla's kernels (on Hopper with the backend's chunk_bwd_dqkwg fix) vs the CPU path."""
    r, kappa, log_gamma, lam = _inputs(B=1, T=1000, H=4, K=64, dtype=torch.float32)
    weights = torch.randn(r.shape)

    def grads(device):
        leaves = [x.to(device).requires_grad_(True) for x in (r, kappa, log_gamma, lam)]
        q, _ = ccq_read_chunk(*leaves, 2, True)
        return [g.cpu() for g in torch.autograd.grad((q * weights.to(device)).sum(), leaves)]

    for name, a, b in zip(("r", "kappa", "log_gamma", "lam"), grads("cuda"), grads("cpu")):
        relative = ((a - b).norm() / b.norm()).item()
        print(f"d{name}: relative L2 error GPU vs CPU = {relative:.2e}")
        assert relative < 5e-3
