"""fla_cpu.torch_chunk_bwd_dqkwg (fla's chunk_bwd_dqkwg in torch, the fla #640 workaround) against
autograd through an independent per-step recurrence, and the routing between fla and it.

The reference runs S <- exp(g_t) S + k_t v_t^T, o_t = scale * S^T q_t token by token in float64;
the state at the end of every chunk is kept (retain_grad), so h[n] (state at the start of chunk n)
and dh[n] (dL/d state at the end of chunk n) are exactly what fla feeds the kernel. T = 150 is not a
multiple of the chunk size, so the last chunk is partial.
"""

import functools
import math

import pytest
import torch

from ccq_eval.model import fla_cpu
from ccq_eval.model.fla_cpu import dqkwg

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
C = 64
B, T, K, V = 2, 150, 32, 48


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def randn(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=F64).requires_grad_(requires_grad)


def chunked(x):
    """[B, T, ...] -> [B, N, C, ...] zero-padded (the test's own chunking)."""
    n = -(-x.shape[1] // C)
    pad = x.new_zeros(x.shape[0], n * C - x.shape[1], *x.shape[2:])
    return torch.cat([x, pad], 1).reshape(x.shape[0], n, C, *x.shape[2:])


def unchunked(x):
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :T]


@functools.cache  # built once per configuration; callers never modify the tensors
def reference(H, HV, gate, h0=True):
    """Inputs, fla-style h / dh and autograd gradients of L = <o, do> + <S_T, dht>.

    gate: 'g' (per-step log decay [B,T,HV]), 'gamma' (constant per head [HV]) or None.
    q, k have H heads, shared by groups of HV // H value heads (as fla's grouped value heads)."""
    torch.manual_seed(1234)
    q, k = randn(B, T, H, K, requires_grad=True), randn(B, T, H, K, requires_grad=True)
    v = randn(B, T, HV, V, requires_grad=True)
    do, dht = randn(B, T, HV, V), randn(B, HV, K, V)
    gamma = None
    if gate == "g":
        g_step = (-torch.rand(B, T, HV, dtype=F64) * 0.3).requires_grad_(True)
    elif gate == "gamma":
        gamma = -torch.rand(HV, dtype=F64) * 0.3
        g_step = gamma.expand(B, T, HV)
    else:
        g_step = torch.zeros(B, T, HV, dtype=F64)
    scale = K**-0.5
    qe, ke = q.repeat_interleave(HV // H, 2), k.repeat_interleave(HV // H, 2)

    S = randn(B, HV, K, V) if h0 else torch.zeros(B, HV, K, V, dtype=F64)
    starts, ends, outs = [], [], []
    for t in range(T):
        if t % C == 0:
            starts.append(S.detach())
        S = g_step[:, t].exp()[..., None, None] * S + ke[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", qe[:, t], S))
        if t % C == C - 1 or t == T - 1:
            # a node of its own: dh[n] is the gradient through the carried state only, not
            # through o_t of the chunk's last position, which reads the same S
            S = S.clone()
            S.retain_grad()
            ends.append(S)
    ((torch.stack(outs, 1) * do).sum() + (S * dht).sum()).backward()

    g_cum = None
    if gate == "g":  # what fla passes: chunk-local cumsum in log2 units
        g_cum = unchunked(chunked(g_step.detach()).cumsum(2) / math.log(2))
    return dict(
        q=q.detach(), k=k.detach(), v=v.detach(), do=do, scale=scale,
        h=torch.stack(starts, 1), dh=torch.stack([e.grad for e in ends], 1),
        g=g_cum, g_gamma=None if gamma is None else gamma / math.log(2),
        dq=q.grad, dk=k.grad, dg_step=g_step.grad if gate == "g" else None,
    )


def call(ref, state_v_first=False, **extra):
    h, dh = ref["h"], ref["dh"]
    if state_v_first:
        h, dh = h.transpose(-1, -2), dh.transpose(-1, -2)
    return fla_cpu.torch_chunk_bwd_dqkwg(
        q=ref["q"], k=ref["k"], v=ref["v"], do=ref["do"], h=h, dh=dh, g=ref["g"], g_gamma=ref["g_gamma"],
        scale=ref["scale"], state_v_first=state_v_first, **extra,
    )


def reverse_chunk_cumsum(x):
    return unchunked(chunked(x).flip(2).cumsum(2).flip(2))


# ---------------------------------------------------------------- values against autograd


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("H, HV", [(2, 2), (1, 2)])
def test_gated_matches_autograd(H, HV, state_v_first):
    ref = reference(H, HV, "g")
    dq, dk, dw, dg = call(ref, state_v_first)
    assert dw is None
    assert dq.shape == (B, T, H, K) and dk.shape == (B, T, H, K) and dg.shape == (B, T, HV)
    torch.testing.assert_close(dq, ref["dq"], **TOL)
    torch.testing.assert_close(dk, ref["dk"], **TOL)
    # fla applies the within-chunk reverse cumsum afterwards; then it is dL/d(per-step g)
    torch.testing.assert_close(reverse_chunk_cumsum(dg), ref["dg_step"], **TOL)


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("gate", ["gamma", None])
def test_gamma_and_ungated_match_autograd(gate, state_v_first):
    ref = reference(2, 2, gate, h0=gate is None)
    dq, dk, dw, dg = call(ref, state_v_first)
    assert dw is None and dg is None
    torch.testing.assert_close(dq, ref["dq"], **TOL)
    torch.testing.assert_close(dk, ref["dk"], **TOL)


def test_g_takes_precedence_over_g_gamma():
    # the kernel checks USE_G first: a g_gamma passed with g is ignored
    ref = reference(2, 2, "g")
    expected = call(ref)
    got = call({**ref, "g_gamma": torch.full((2,), -5.0, dtype=F64)})
    for a, b in zip(expected, got):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("state_v_first", [False, True])
def test_delta_rule_dw(state_v_first):
    ref = reference(2, 2, "g")
    w, dv = randn(B, T, 2, K), randn(B, T, 2, V)
    dq, dk, dw, dg = call(ref, state_v_first, w=w, dv=dv)
    # dw_t = -(h[chunk of t] @ dv_t) with h K-first [K, V]
    h_t = ref["h"][:, torch.arange(T) // C]  # [B, T, HV, K, V]
    torch.testing.assert_close(dw, -torch.einsum("bthkv,bthv->bthk", h_t, dv), **TOL)
    assert dw.dtype == w.dtype
    # dq, dk, dg do not depend on w / dv
    plain = call(ref, state_v_first)
    for a, b in zip((dq, dk, dg), (plain[0], plain[1], plain[3])):
        assert torch.equal(a, b)


def test_fla_dtypes_for_half_inputs():
    # simple_gla style: bf16 q/k/v/do, fp32 states and g -> dq, dk bf16, dg fp32 (as fla returns)
    ref = reference(2, 2, "g")
    half = {name: ref[name].to(torch.bfloat16) for name in ("q", "k", "v", "do")}
    fp32 = {name: ref[name].float() for name in ("h", "dh", "g")}
    dq, dk, _, dg = call({**ref, **half, **fp32})
    assert dq.dtype == dk.dtype == torch.bfloat16 and dg.dtype == torch.float32
    exact = call({**ref, **{n: x.double() for n, x in half.items()}})
    torch.testing.assert_close(dq.double(), exact[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dg.double(), exact[3], rtol=1e-4, atol=1e-3)


def test_varlen_not_supported():
    ref = reference(2, 2, "g")
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        call(ref, cu_seqlens=torch.tensor([0, 100, T]))


# ---------------------------------------------------------------- routing


def test_wrapper_routing(monkeypatch):
    from fla.ops.common import chunk_o

    ref = reference(2, 2, "g")
    args = dict(q=ref["q"], k=ref["k"], v=ref["v"], do=ref["do"], h=ref["h"], dh=ref["dh"], g=ref["g"])
    seen = []
    wrapper = dqkwg._hopper_dqkwg(lambda *a, **kw: seen.append(kw["g"]) or "fla")

    # fla's guard flags all set, but CPU tensors: fla's own function
    flags = {"IS_NVIDIA_HOPPER": True, "TRITON_ABOVE_3_4_0": True, "TRITON_ABOVE_3_7_1": False}
    for name, value in flags.items():
        monkeypatch.setattr(chunk_o, name, value)
    assert not dqkwg._hits_fla_640(ref["q"], ref["g"])
    assert wrapper(**args) == "fla" and seen[-1] is ref["g"]

    # where the guard would raise: the torch version, called with the same arguments
    monkeypatch.setattr(dqkwg, "_hits_fla_640", lambda q, g: g is not None)
    dq, dk, _, _ = wrapper(**args, scale=ref["scale"])
    torch.testing.assert_close(dq, ref["dq"], **TOL)
    torch.testing.assert_close(dk, ref["dk"], **TOL)
    assert wrapper(**{**args, "g": None}) == "fla"
