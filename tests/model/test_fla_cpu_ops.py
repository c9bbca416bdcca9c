"""CPU implementations in ccq_eval.model.fla_cpu against independent references written here.

References are deliberately naive: O(T^2) parallel sums with explicit decay products for the
linear-attention ops, a per-step Householder-form loop for the delta rule, explicit window sums for
the convolution. All in float64 with tight tolerances; T is never a multiple of the chunk size.
"""

import pytest
import torch
import torch.nn.functional as F

from ccq_eval.model import fla_cpu
from ccq_eval.model.fla_cpu import common as fla_common

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def randn(*shape, dtype=F64, requires_grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


# ---------------------------------------------------------------- references (independent code)


def parallel_linear_attention(q, k, v, log_decay, scale, h0=None):
    """O(T^2): o_t = sum_{s<=t} sum_j q_tj k_sj exp(G_tj - G_sj) v_s + (q_t * exp(G_t)) h0,
    G = running sum of the log decays (per channel [B,T,H,K]). h0 is K-first [B,H,K,V]."""
    G = torch.cat([log_decay.new_zeros(log_decay[:, :1].shape), log_decay.cumsum(1)], 1)[:, 1:]
    G_end = log_decay.sum(1, keepdim=True)  # total decay (0 for an empty input)
    T = q.shape[1]
    rel = (G[:, :, None] - G[:, None, :]).exp()  # [B, t, s, H, K]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, :, :, None, None]
    weights = torch.where(causal, q[:, :, None] * k[:, None, :] * rel, 0.0).sum(-1) * scale  # [B,t,s,H]
    o = torch.einsum("btsh,bshv->bthv", weights, v)
    final = torch.einsum("bshk,bshv->bhkv", k * (G_end - G).exp(), v)
    if h0 is not None:
        o = o + torch.einsum("bthk,bhkv->bthv", q * G.exp() * scale, h0)
        final = final + G_end[:, 0].exp()[..., None] * h0
    return o, final


def householder_delta_rule(q, k, v, g, beta, scale, h0=None):
    """Per step, V-first state S [V,K]: S <- exp(g) S (I - beta k k^T) + beta v k^T, o = S q * scale.
    q, k [B,T,HV,K] (already normalised, one per value head); returns V-first final state."""
    B, T, HV, K = k.shape
    V = v.shape[-1]
    S = torch.zeros(B, HV, V, K, dtype=q.dtype) if h0 is None else h0.clone()
    eye = torch.eye(K, dtype=q.dtype)
    outs = []
    for t in range(T):
        kt, bt = k[:, t], beta[:, t][..., None, None]
        S = (
            g[:, t].exp()[..., None, None] * S @ (eye - bt * kt[..., :, None] * kt[..., None, :])
            + bt * v[:, t][..., :, None] * kt[..., None, :]
        )
        outs.append(S @ (q[:, t] * scale)[..., None])
    return torch.stack(outs, 1).squeeze(-1), S


def window_conv(x, weight, bias, history, activation):
    """y_t = act(sum_{i<W} w[:, i] * x_{t-W+1+i} + b), earlier inputs taken from `history` [B,D,W]."""
    B, T, D = x.shape
    W = weight.shape[1]
    past = torch.zeros(B, W, D, dtype=x.dtype) if history is None else history.transpose(1, 2)
    seq = torch.cat([past, x], 1)  # position t of x is index W + t
    y = torch.stack([sum(weight[:, i] * seq[:, W + t - (W - 1) + i] for i in range(W)) for t in range(T)], 1)
    if bias is not None:
        y = y + bias
    return F.silu(y) if activation in ("silu", "swish") else y


# ---------------------------------------------------------------- GLA family


@pytest.mark.parametrize("T", [1, 37, 150])
def test_chunk_gla_matches_parallel_reference(T):
    B, H, K, V = 2, 3, 16, 8
    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    g = F.logsigmoid(randn(B, T, H, K) * 2) / 4
    h0 = randn(B, H, K, V)
    o, ht = fla_cpu.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = parallel_linear_attention(q, k, v, g, K**-0.5, h0)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


def test_chunk_and_recurrent_gla_state_v_first_and_scale():
    B, T, H, K, V = 1, 130, 2, 8, 4
    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    g = F.logsigmoid(randn(B, T, H, K))
    h0 = randn(B, H, K, V)
    o_ref, ht_ref = parallel_linear_attention(q, k, v, g, 0.3, h0)
    for op in (fla_cpu.chunk_gla, fla_cpu.fused_recurrent_gla):
        o, ht = op(
            q,
            k,
            v,
            g,
            scale=0.3,
            initial_state=h0.transpose(-1, -2),
            output_final_state=True,
            state_v_first=True,
        )
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(ht, ht_ref.transpose(-1, -2), **TOL)
    o, ht = fla_cpu.chunk_gla(q, k, v, g, scale=0.3)
    assert ht is None


def test_chunk_gla_segments_and_extreme_decay_stay_exact(monkeypatch):
    # several segments (state carried across) and decays far beyond exp's fp32 range within one chunk
    monkeypatch.setattr(fla_common, "SEGMENT_TOKENS", 128)
    B, T, H, K, V = 1, 300, 2, 8, 4
    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    g = -torch.rand(B, T, H, K, dtype=F64) * 60  # up to exp(-60) per step
    o, ht = fla_cpu.chunk_gla(q.float(), k.float(), v.float(), g.float(), output_final_state=True)
    o_ref, ht_ref = parallel_linear_attention(q, k, v, g, K**-0.5)
    assert torch.isfinite(o).all() and ht.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-4, atol=1e-4)


def test_fused_recurrent_gla_reverse_and_value_decay():
    B, T, H, K, V = 2, 20, 2, 4, 3
    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    gk, gv = F.logsigmoid(randn(B, T, H, K)), F.logsigmoid(randn(B, T, H, V))
    o, ht = fla_cpu.fused_recurrent_gla(q, k, v, gk, gv, output_final_state=True, reverse=True)
    # reverse = the forward recurrence on time-flipped inputs, outputs flipped back
    S = torch.zeros(B, H, K, V, dtype=F64)
    expected = torch.empty(B, T, H, V, dtype=F64)
    for t in reversed(range(T)):
        S = (
            gk[:, t].exp()[..., :, None] * S * gv[:, t].exp()[..., None, :]
            + k[:, t, ..., :, None] * v[:, t, ..., None, :]
        )
        expected[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * K**-0.5, S)
    torch.testing.assert_close(o, expected, **TOL)
    torch.testing.assert_close(ht, S, **TOL)


@pytest.mark.parametrize("decay", ["g", "g_gamma", "none"])
def test_chunk_simple_gla_matches_parallel_reference(decay):
    B, T, H, K, V = 2, 100, 3, 8, 5
    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    h0 = randn(B, H, K, V)
    g = F.logsigmoid(randn(B, T, H))
    gamma = -torch.rand(H, dtype=F64)
    kwargs = {"g": {"g": g}, "g_gamma": {"g_gamma": gamma}, "none": {}}[decay]
    full = {"g": g, "g_gamma": gamma.expand(B, T, H), "none": torch.zeros(B, T, H, dtype=F64)}[decay]
    o_ref, ht_ref = parallel_linear_attention(q, k, v, full[..., None].expand(B, T, H, K), 1.0, h0)
    for op in (fla_cpu.chunk_simple_gla, fla_cpu.fused_recurrent_simple_gla):
        o, ht = op(q, k, v, scale=1.0, initial_state=h0, output_final_state=True, **kwargs)
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(ht, ht_ref, **TOL)


def test_simple_gla_with_v_equal_k_is_symmetric_read():
    # the CCQ covariance pass: sum_s w_{s,t} k_s (k_s . u_t) with scalar decay is a symmetric operator in u
    B, T, H, K = 1, 70, 2, 6
    k = randn(B, T, H, K)
    g = F.logsigmoid(randn(B, T, H))
    a, b = randn(B, T, H, K), randn(B, T, H, K)
    Pa, _ = fla_cpu.chunk_simple_gla(a, k, k, g=g, scale=1.0)
    Pb, _ = fla_cpu.chunk_simple_gla(b, k, k, g=g, scale=1.0)
    torch.testing.assert_close((Pa * b).sum(-1), (Pb * a).sum(-1), **TOL)


def test_gla_ops_agree_with_fla_naive_references():
    # second check against fla's own pure-torch references (fp32 there)
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    B, T, H, K, V = 1, 90, 2, 16, 16
    q, k, v = (
        randn(B, T, H, K, dtype=torch.float32),
        randn(B, T, H, K, dtype=torch.float32),
        randn(B, T, H, V, dtype=torch.float32),
    )
    gk = F.logsigmoid(randn(B, T, H, K, dtype=torch.float32)) / 16
    h0 = randn(B, H, K, V, dtype=torch.float32)
    o, ht = fla_cpu.chunk_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-4, atol=1e-4)
    g = F.logsigmoid(randn(B, T, H, dtype=torch.float32))
    o, ht = fla_cpu.chunk_simple_gla(q, k, v, g=g, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_recurrent_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-4, atol=1e-4)


def test_chunk_gla_gradcheck():
    B, T, H, K, V = 1, 70, 1, 3, 2  # two chunks, padded tail, all sub-blocks
    q, k, v = (
        randn(B, T, H, K, requires_grad=True),
        randn(B, T, H, K, requires_grad=True),
        randn(B, T, H, V, requires_grad=True),
    )
    g = (F.logsigmoid(randn(B, T, H, K)) / 2).requires_grad_()
    h0 = randn(B, H, K, V, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *xs: fla_cpu.chunk_gla(*xs[:4], initial_state=xs[4], output_final_state=True),
        (q, k, v, g, h0),
        fast_mode=True,
    )


def test_linear_attention_grads_match_reference_grads(monkeypatch):
    monkeypatch.setattr(fla_common, "SEGMENT_TOKENS", 64)  # checkpointed segments in backward
    B, T, H, K, V = 2, 150, 2, 4, 3
    inputs = [
        randn(B, T, H, K, requires_grad=True),
        randn(B, T, H, K, requires_grad=True),
        randn(B, T, H, V, requires_grad=True),
    ]
    g = (F.logsigmoid(randn(B, T, H, K)) / 2).requires_grad_()
    gs = F.logsigmoid(randn(B, T, H)).requires_grad_()
    h0 = randn(B, H, K, V, requires_grad=True)
    w_o, w_h = randn(B, T, H, V), randn(B, H, K, V)

    def grads(fn, *leaves):
        o, ht = fn()
        return torch.autograd.grad((o * w_o).sum() + (ht * w_h).sum(), leaves)

    leaves = (*inputs, g, h0)
    for mine, ref in zip(
        grads(lambda: fla_cpu.chunk_gla(*inputs, g, initial_state=h0, output_final_state=True), *leaves),
        grads(lambda: parallel_linear_attention(*inputs, g, K**-0.5, h0), *leaves),
        strict=True,
    ):
        torch.testing.assert_close(mine, ref, **TOL)
    leaves = (*inputs, gs, h0)
    gs_full = gs[..., None].expand(B, T, H, K)
    for mine, ref in zip(
        grads(
            lambda: fla_cpu.chunk_simple_gla(*inputs, g=gs, initial_state=h0, output_final_state=True),
            *leaves,
        ),
        grads(lambda: parallel_linear_attention(*inputs, gs_full, K**-0.5, h0), *leaves),
        strict=True,
    ):
        torch.testing.assert_close(mine, ref, **TOL)


def test_gla_varlen_equals_separate_sequences():
    H, K, V = 2, 4, 3
    lengths = [5, 70, 0, 33]
    total = sum(lengths)
    q, k, v = randn(1, total, H, K), randn(1, total, H, K), randn(1, total, H, V)
    g = F.logsigmoid(randn(1, total, H, K))
    h0 = randn(len(lengths), H, K, V)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for op in (fla_cpu.chunk_gla, fla_cpu.fused_recurrent_gla):
        o, ht = op(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            o_ref, ht_ref = parallel_linear_attention(
                q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], K**-0.5, h0[i : i + 1]
            )
            torch.testing.assert_close(o[:, a:b], o_ref, **TOL)
            torch.testing.assert_close(ht[i : i + 1], ht_ref, **TOL)
    with pytest.raises(ValueError, match="batch size to be 1"):
        fla_cpu.chunk_gla(
            q.expand(2, -1, -1, -1),
            k.expand(2, -1, -1, -1),
            v.expand(2, -1, -1, -1),
            g.expand(2, -1, -1, -1),
            cu_seqlens=cu,
        )


def test_low_precision_inputs_compute_in_fp32():
    B, T, H, K, V = 1, 100, 2, 16, 16
    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    g = F.logsigmoid(randn(B, T, H, K)) / 16
    lo = [x.bfloat16() for x in (q, k, v, g)]
    o, ht = fla_cpu.chunk_gla(*lo, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    o_ref16, ht_ref16 = parallel_linear_attention(*[x.double() for x in lo], K**-0.5)
    torch.testing.assert_close(o.double(), o_ref16, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ht.double(), ht_ref16, rtol=1e-4, atol=1e-4)  # fp32 accumulation


# ---------------------------------------------------------------- gated delta rule


def gdn_case(B=2, T=150, H=2, HV=4, K=8, V=6, dtype=F64):
    return {
        "q": randn(B, T, H, K, dtype=dtype),
        "k": randn(B, T, H, K, dtype=dtype),
        "v": randn(B, T, HV, V, dtype=dtype),
        "a": randn(B, T, HV, dtype=dtype),
        "b": randn(B, T, HV, dtype=dtype),
        "A_log": torch.log(torch.rand(HV, dtype=dtype) * 16 + 0.5),
        "dt_bias": randn(HV, dtype=dtype) - 3,
        "h0": randn(B, HV, V, K, dtype=dtype),
    }


def gdn_reference(c, allow_neg_eigval=False, scale=None):
    """fla's in-kernel preprocessing spelled out, then the Householder-form recurrence."""
    HV, H, K = c["v"].shape[2], c["q"].shape[2], c["q"].shape[-1]
    unit = [x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (c["q"], c["k"])]
    q, k = [x.repeat_interleave(HV // H, dim=2) for x in unit]
    beta = torch.sigmoid(c["b"]) * (2 if allow_neg_eigval else 1)
    g = -c["A_log"].exp() * F.softplus(c["a"] + c["dt_bias"])
    return householder_delta_rule(q, k, c["v"], g, beta, K**-0.5 if scale is None else scale, c["h0"])


def gdn_kwargs(c, allow_neg_eigval=False):
    return {
        "g": c["a"],
        "beta": c["b"],
        "initial_state": c["h0"],
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": True,
        "use_beta_sigmoid_in_kernel": True,
        "allow_neg_eigval": allow_neg_eigval,
        "state_v_first": True,
        "use_gate_in_kernel": True,
        "A_log": c["A_log"],
        "dt_bias": c["dt_bias"],
    }


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
@pytest.mark.parametrize("T", [1, 150])
def test_gated_delta_rule_matches_householder_reference(T, allow_neg_eigval):
    c = gdn_case(T=T)
    o_ref, ht_ref = gdn_reference(c, allow_neg_eigval)
    for op in (fla_cpu.chunk_gated_delta_rule, fla_cpu.fused_recurrent_gated_delta_rule):
        o, ht = op(c["q"], c["k"], c["v"], **gdn_kwargs(c, allow_neg_eigval))
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(ht, ht_ref, **TOL)


def test_gated_delta_rule_preprocessed_inputs_and_k_first_state(monkeypatch):
    # kernel flags off: q/k/beta/g are used as given; K-first states; several segments
    monkeypatch.setattr(fla_common, "SEGMENT_TOKENS", 128)
    B, T, H, K, V = 1, 300, 2, 8, 4
    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v, beta = randn(B, T, H, V), torch.rand(B, T, H, dtype=F64)
    g = -torch.rand(B, T, H, dtype=F64) * 30  # strong decays: exp(-30) per step
    h0 = randn(B, H, K, V)
    o_ref, ht_ref = householder_delta_rule(q, k, v, g, beta, 0.5, h0.transpose(-1, -2))
    for op in (fla_cpu.chunk_gated_delta_rule, fla_cpu.fused_recurrent_gated_delta_rule):
        o, ht = op(q, k, v, g=g, beta=beta, scale=0.5, initial_state=h0, output_final_state=True)
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(ht, ht_ref.transpose(-1, -2), **TOL)


def test_gated_delta_rule_agrees_with_fla_naive_references():
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

    B, T, H, K, V = 1, 100, 2, 16, 16
    f32 = torch.float32
    q, k = (
        F.normalize(randn(B, T, H, K, dtype=f32), dim=-1),
        F.normalize(randn(B, T, H, K, dtype=f32), dim=-1),
    )
    v, beta = randn(B, T, H, V, dtype=f32), torch.rand(B, T, H)
    g = F.logsigmoid(randn(B, T, H, dtype=f32))
    h0 = randn(B, H, K, V, dtype=f32)
    o, ht = fla_cpu.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for naive in (naive_recurrent_gated_delta_rule, naive_chunk_gated_delta_rule):
        args = (q, k, v, beta, g) if naive is naive_recurrent_gated_delta_rule else (q, k, v, g, beta)
        o_ref, ht_ref = naive(*args, initial_state=h0, output_final_state=True)
        torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ht, ht_ref, rtol=1e-4, atol=1e-4)


def test_chunk_gated_delta_rule_gradcheck():
    c = gdn_case(B=1, T=70, H=1, HV=1, K=3, V=2)
    names = ["q", "k", "v", "a", "b", "A_log", "dt_bias", "h0"]
    leaves = [c[n].requires_grad_() for n in names]

    def fn(*xs):
        d = dict(zip(names, xs, strict=True))
        return fla_cpu.chunk_gated_delta_rule(d["q"], d["k"], d["v"], **gdn_kwargs(d))

    assert torch.autograd.gradcheck(fn, leaves, fast_mode=True)


def test_gated_delta_rule_grads_match_reference_grads(monkeypatch):
    monkeypatch.setattr(fla_common, "SEGMENT_TOKENS", 64)
    c = gdn_case(B=2, T=150, H=1, HV=2, K=4, V=3)
    names = ["q", "k", "v", "a", "b", "A_log", "dt_bias", "h0"]
    leaves = [c[n].requires_grad_() for n in names]
    w_o, w_h = randn(2, 150, 2, 3), randn(2, 2, 3, 4)

    def grads(out):
        o, ht = out
        return torch.autograd.grad((o * w_o).sum() + (ht * w_h).sum(), leaves)

    for mine, ref in zip(
        grads(fla_cpu.chunk_gated_delta_rule(c["q"], c["k"], c["v"], **gdn_kwargs(c))),
        grads(gdn_reference(c)),
        strict=True,
    ):
        torch.testing.assert_close(mine, ref, **TOL)


def test_gated_delta_rule_varlen_equals_separate_sequences():
    c = gdn_case(B=1, T=110, H=1, HV=2, K=4, V=3)
    cu = torch.tensor([0, 3, 80, 110])
    c["h0"] = randn(3, 2, 3, 4)
    for op in (fla_cpu.chunk_gated_delta_rule, fla_cpu.fused_recurrent_gated_delta_rule):
        o, ht = op(c["q"], c["k"], c["v"], **gdn_kwargs(c), cu_seqlens=cu)
        for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            part = {n: (c[n][:, a:b] if n in "qkvab" else c[n]) for n in c}
            part["h0"] = c["h0"][i : i + 1]
            o_ref, ht_ref = gdn_reference(part)
            torch.testing.assert_close(o[:, a:b], o_ref, **TOL)
            torch.testing.assert_close(ht[i : i + 1], ht_ref, **TOL)


def test_gated_delta_rule_clear_errors():
    c = gdn_case(B=1, T=5, H=2, HV=3)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        fla_cpu.chunk_gated_delta_rule(c["q"], c["k"], c["v"], c["a"], c["b"])
    c = gdn_case(B=1, T=5)
    with pytest.raises(ValueError, match="use_beta_sigmoid_in_kernel"):
        fla_cpu.chunk_gated_delta_rule(c["q"], c["k"], c["v"], c["a"], c["b"], allow_neg_eigval=True)
    with pytest.raises(ValueError, match="A_log"):
        fla_cpu.fused_recurrent_gated_delta_rule(
            c["q"], c["k"], c["v"], g=c["a"], beta=c["b"], use_gate_in_kernel=True
        )


# ---------------------------------------------------------------- small ops


def test_l2norm_matches_formula_and_keeps_dtype():
    x = randn(3, 5, 7)
    torch.testing.assert_close(fla_cpu.l2norm(x), x / torch.sqrt((x**2).sum(-1, keepdim=True) + 1e-6), **TOL)
    xb = x.bfloat16()
    assert fla_cpu.l2norm(xb).dtype == torch.bfloat16
    assert fla_cpu.l2norm(xb, output_dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_prefill_state_and_decode(activation):
    B, T, D, W = 2, 11, 5, 4
    x, weight, bias = randn(B, T, D), randn(D, W), randn(D)
    history = randn(B, D, W)
    y, final = fla_cpu.causal_conv1d(
        x, weight, bias, initial_state=history, output_final_state=True, activation=activation
    )
    torch.testing.assert_close(y, window_conv(x, weight, bias, history, activation), **TOL)
    torch.testing.assert_close(final, x[:, -W:].transpose(1, 2), **TOL)  # the last W inputs
    # a sequence shorter than the window keeps the newest part of the history
    _y2, final2 = fla_cpu.causal_conv1d(
        x[:, :2], weight, bias, initial_state=history, output_final_state=True, activation=activation
    )
    torch.testing.assert_close(final2, torch.cat([history[..., 2:], x[:, :2].transpose(1, 2)], -1), **TOL)
    # decode: prefill T-1 tokens, then one step that updates the cache in place
    _, cache = fla_cpu.causal_conv1d(
        x[:, :-1], weight, bias, initial_state=history, output_final_state=True, activation=activation
    )
    cache_before = cache
    y_step, cache_after = fla_cpu.causal_conv1d_update(
        x[:, -1:], cache, weight=weight, bias=bias, activation=activation
    )
    assert cache_after is cache_before
    torch.testing.assert_close(y_step, y[:, -1:], **TOL)
    torch.testing.assert_close(cache_after, final, **TOL)
    # residual is added after the activation
    r = randn(B, T, D)
    y_r, _ = fla_cpu.causal_conv1d(x, weight, bias, residual=r, initial_state=history, activation=activation)
    torch.testing.assert_close(y_r, y + r, **TOL)


def test_short_convolution_module_paths():
    from fla.modules import ShortConvolution

    conv = fla_cpu.use_torch_backend(ShortConvolution(hidden_size=6, kernel_size=4, bias=True, activation="silu"))
    conv = conv.double()
    x = randn(2, 9, 6)
    weight = conv.weight.detach().squeeze(1)
    with torch.no_grad():
        full, _ = conv(x)
        torch.testing.assert_close(full, window_conv(x, weight, conv.bias, None, "silu"), **TOL)
        _, cache = conv(x[:, :5], output_final_state=True)
        steps = []
        for t in range(5, 9):
            y, returned = conv(x[:, t : t + 1], cache=cache, output_final_state=True)
            assert returned is cache  # decode updates the cache in place
            steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 5:], **TOL)
    # with autograd a one-token call is a normal convolution and gradients flow
    xg = x[:, :1].clone().requires_grad_()
    y, _ = conv(xg)
    y.sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


def test_rms_norms_and_gates():
    from fla.modules import FusedRMSNormGated, RMSNorm

    x, r, g = randn(3, 4, 8), randn(3, 4, 8), randn(3, 4, 8)
    norm = fla_cpu.use_torch_backend(RMSNorm(8, eps=1e-5)).double()
    with torch.no_grad():
        norm.weight.copy_(randn(8))
    w = norm.weight

    def rms(z):
        return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    torch.testing.assert_close(norm(x), rms(x), **TOL)
    y, resid = norm(x, r, True)
    torch.testing.assert_close(y, rms(x + r), **TOL)
    torch.testing.assert_close(resid, x + r, **TOL)
    xb = x.float()
    y, resid = norm.float()(xb, None, True, True)
    assert resid is not None and resid.dtype == torch.float32
    for activation, gate in (("swish", g * torch.sigmoid(g)), ("sigmoid", torch.sigmoid(g))):
        gated = fla_cpu.use_torch_backend(FusedRMSNormGated(8, eps=1e-5, activation=activation)).double()
        with torch.no_grad():
            gated.weight.copy_(w)
        torch.testing.assert_close(gated(x, g), rms(x) * gate, **TOL)
    yb = norm.bfloat16()(x.bfloat16())
    assert yb.dtype == torch.bfloat16


def test_activations_swiglu_and_losses():
    from fla.modules import FusedCrossEntropyLoss, FusedLinearCrossEntropyLoss, GatedMLP

    x, y = randn(4, 6), randn(4, 6)
    torch.testing.assert_close(fla_cpu.swish(x), x * torch.sigmoid(x), **TOL)
    torch.testing.assert_close(fla_cpu.sigmoid(x), torch.sigmoid(x), **TOL)
    torch.testing.assert_close(fla_cpu.logsigmoid(x), torch.log(torch.sigmoid(x)), **TOL)
    torch.testing.assert_close(fla_cpu.swiglu(x, y), x * torch.sigmoid(x) * y, **TOL)

    def backend(module):
        return fla_cpu.use_torch_backend(module)

    mlp = backend(GatedMLP(hidden_size=8, intermediate_size=16, fuse_swiglu=True)).double()
    h = randn(2, 3, 8)
    expected = mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
    torch.testing.assert_close(mlp(h), expected, **TOL)
    mlp.fuse_swiglu = False
    torch.testing.assert_close(mlp(h), expected, **TOL)

    logits, target = randn(10, 7, requires_grad=True), torch.randint(0, 7, (10,))
    target[3] = -100
    for smoothing in (0.0, 0.1):
        loss = backend(FusedCrossEntropyLoss(label_smoothing=smoothing))(logits, target)
        torch.testing.assert_close(loss, F.cross_entropy(logits, target, label_smoothing=smoothing), **TOL)
    summed = backend(FusedCrossEntropyLoss(reduction="sum", lse_square_scale=1e-2, return_z_loss=True))(
        logits, target)
    lse = torch.logsumexp(logits, -1)[target != -100]
    z_expected = 1e-2 * (lse**2).sum()
    torch.testing.assert_close(
        summed[0], F.cross_entropy(logits, target, reduction="sum") + z_expected, **TOL
    )
    torch.testing.assert_close(summed[1], z_expected, **TOL)

    hidden, weight = randn(2, 5, 8, requires_grad=True), randn(7, 8, requires_grad=True)
    tgt = torch.randint(0, 7, (2, 5))
    fused = backend(FusedLinearCrossEntropyLoss())(hidden, tgt, weight)
    plain = F.cross_entropy(hidden.reshape(-1, 8) @ weight.T, tgt.reshape(-1))
    torch.testing.assert_close(fused, plain, **TOL)
    gf = torch.autograd.grad(fused, (hidden, weight))
    gp = torch.autograd.grad(plain, (hidden, weight))
    for a, b in zip(gf, gp, strict=True):
        torch.testing.assert_close(a, b, **TOL)

