"""DeltaNet, KDA, preconditioned Gated DeltaNet and preconditioned KDA on CPU (fla_cpu.delta_variants).

The ops against fla's own pure-torch references (fla/ops/*/naive.py) in float64 with tight tolerances: those
references cast their inputs to float32, so each runs as a copy that finds a `torch` whose float32 is
float64 (`in_float64`, fla's code unchanged). T is never a multiple of the chunk size; initial and final
states throughout. Then tiny random models of the four families (fla's classes, use_torch_backend): forward,
training step, chunked prefill + decoding against one full forward, padded batches, bf16, long inputs.
"""

import time

import pytest
import torch
import torch.nn.functional as F
from cache_support import prefill_then_decode
from fla.models.utils import Cache
from transformers import AutoConfig, AutoModelForCausalLM

from ccq_eval.model import fla_cpu
from ccq_eval.model.fla_cpu import common as fla_common
from ccq_eval.model.fla_cpu import delta_variants as dv
from ccq_eval.model.fla_cpu import dispatch

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def randn(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype)


class _Float64Torch:
    """torch, with `float32` and `float` meaning float64."""

    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def in_float64(reference):
    """A copy of one of fla's naive references that computes in float64 (its `torch.float32` casts become float64)."""
    return fla_cpu.rebind(reference, torch=_Float64Torch())


def l2(x):
    """fla's in-kernel l2 normalisation (eps inside the root)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_gate_reference(raw, A_log, dt_bias, lower_bound=None):
    HV, K = raw.shape[-2:]
    x = raw + dt_bias.view(HV, K)
    if lower_bound is None:
        return -A_log.exp()[:, None] * F.softplus(x)
    return lower_bound * torch.sigmoid(A_log.exp()[:, None] * x)


# ---------------------------------------------------------------- DeltaNet


def test_delta_rule_matches_fla_naive_references():
    from fla.ops.delta_rule.naive import delta_rule_chunkwise, delta_rule_recurrence
    from fla.ops.kda.naive import naive_recurrent_kda

    B, T, H, K, V = 2, 150, 2, 8, 6
    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    beta, h0 = torch.rand(B, T, H, dtype=F64), randn(B, H, K, V)
    # fla's chunkwise DeltaNet (whole chunks, no initial state), float64
    n = 128
    qn, kn = F.normalize(q[:, :n], dim=-1), F.normalize(k[:, :n], dim=-1)
    o_ref, ht_ref = in_float64(delta_rule_chunkwise)(*(x.transpose(1, 2) for x in (qn, kn, v[:, :n], beta[:, :n])))
    for op in (dv.torch_chunk_delta_rule, dv.torch_fused_recurrent_delta_rule):
        o, ht = op(qn, kn, v[:, :n], beta[:, :n], output_final_state=True)
        torch.testing.assert_close(o, o_ref.transpose(1, 2), **TOL)
        torch.testing.assert_close(ht, ht_ref, **TOL)
    # with an initial state, T not a multiple of the chunk, in-kernel l2norm: KDA's recurrence at zero decay
    o_ref, ht_ref = in_float64(naive_recurrent_kda)(
        l2(q), l2(k), v, torch.zeros(B, T, H, K, dtype=F64), beta, initial_state=h0, output_final_state=True)
    for op in (dv.torch_chunk_delta_rule, dv.torch_fused_recurrent_delta_rule):
        o, ht = op(q, k, v, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(ht, ht_ref, **TOL)
    # fla's DeltaNet recurrence itself computes in float32
    f32 = [x.float() for x in (l2(q), l2(k), v, beta)]
    o_ref, ht_ref = delta_rule_recurrence(*(x.transpose(1, 2) for x in f32), initial_state=h0.float())
    o, ht = dv.torch_chunk_delta_rule(*f32, initial_state=h0.float(), output_final_state=True)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    torch.testing.assert_close(o, o_ref.transpose(1, 2), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- KDA


def kda_case(B=2, T=150, H=2, HV=4, K=8, V=6):
    return {
        "q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, HV, V), "g": randn(B, T, HV, K),
        "beta": randn(B, T, HV), "A_log": torch.log(torch.rand(HV, dtype=F64) * 15 + 1),
        "dt_bias": randn(HV * K) - 2, "h0": randn(B, HV, V, K),  # V-first, as the KDA layer keeps it
    }


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("T", [1, 150])
def test_kda_matches_fla_naive_recurrence(T, lower_bound):
    from fla.ops.kda.naive import naive_recurrent_kda

    c = kda_case(T=T)
    decay = kda_gate_reference(c["g"], c["A_log"], c["dt_bias"], lower_bound)
    o_ref, ht_ref = in_float64(naive_recurrent_kda)(
        l2(c["q"]), l2(c["k"]), c["v"], decay, 2 * torch.sigmoid(c["beta"]),
        initial_state=c["h0"].transpose(-1, -2), output_final_state=True)
    flags = {"initial_state": c["h0"], "output_final_state": True, "use_qk_l2norm_in_kernel": True,
             "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True,
             "lower_bound": lower_bound, "state_v_first": True, "A_log": c["A_log"], "dt_bias": c["dt_bias"]}
    for op in (dv.torch_chunk_kda, dv.torch_fused_recurrent_kda):
        o, ht = op(c["q"], c["k"], c["v"], c["g"], c["beta"], **flags)
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(ht, ht_ref.transpose(-1, -2), **TOL)


def test_chunk_kda_matches_fla_naive_chunked_form():
    from fla.ops.kda.naive import naive_chunk_kda

    c = kda_case(T=128)
    q, k = l2(c["q"]), l2(c["k"])
    g, beta, h0 = F.logsigmoid(c["g"]), torch.rand(2, 128, 4, dtype=F64), c["h0"].transpose(-1, -2)
    o_ref, ht_ref = in_float64(naive_chunk_kda)(q, k, c["v"], g, beta, initial_state=h0, output_final_state=True)
    o, ht = dv.torch_chunk_kda(q, k, c["v"], g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


def test_fused_kda_gate_matches_fla_naive_gates():
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    raw, A_log, dt_bias = randn(3, 5, 4, 8), randn(4), randn(32)
    f32 = [x.float() for x in (raw, A_log, dt_bias)]
    tight = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(dv.torch_fused_kda_gate(*f32), naive_kda_gate(*f32), **tight)
    for a_log in (f32[1], None):
        torch.testing.assert_close(
            dv.torch_fused_kda_gate(f32[0], a_log, f32[2], lower_bound=-3.0),
            naive_kda_lowerbound_gate(f32[0], a_log, f32[2], lower_bound=-3.0), **tight)
    # float64 stays float64, low precision comes back in output_dtype
    torch.testing.assert_close(dv.torch_fused_kda_gate(raw, A_log, dt_bias), kda_gate_reference(raw, A_log, dt_bias),
                               **TOL)
    assert dv.torch_fused_kda_gate(raw.bfloat16(), f32[1], f32[2]).dtype == torch.float32
    assert dv.torch_fused_kda_gate(f32[0], f32[1], output_dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="A_log"):
        dv.torch_fused_kda_gate(f32[0])


# ---------------------------------------------------------------- preconditioned delta rules


def precond_case(B=2, T=150, H=2, HV=4, K=8, V=6):
    return {
        "q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, HV, V),
        "g": F.logsigmoid(randn(B, T, HV)), "beta": torch.rand(B, T, HV, dtype=F64),
        "g_atk": F.logsigmoid(randn(B, T, H)), "beta_atk": torch.rand(B, T, H, dtype=F64),
        "h0": randn(B, HV, K, V), "A0": torch.rand(B, H, K, dtype=F64), "las": randn(H) * 0.5 - 0.2,
    }


@pytest.mark.parametrize("transpose_state_layout", [False, True])
def test_precond_gated_delta_rule_matches_fla_naive(transpose_state_layout):
    from fla.ops.precond_gated_delta_rule.naive import naive_recurrent_precond_gated_delta_rule as naive

    c = precond_case()
    q, k = F.normalize(c["q"], dim=-1), F.normalize(c["k"], dim=-1)  # the reference normalises without eps
    o_ref, ht_ref, at_ref = in_float64(naive)(
        q, k, c["v"], c["g_atk"], c["g"], c["beta_atk"], c["beta"], initial_state=c["h0"], initial_A_state=c["A0"],
        output_final_state=True, x=1.7, eps=1e-5, log_atk_scale=c["las"])
    h0 = c["h0"].transpose(-1, -2) if transpose_state_layout else c["h0"]
    common = {"initial_state": h0, "initial_A_state": c["A0"], "output_final_state": True,
              "use_qk_l2norm_in_kernel": False, "transpose_state_layout": transpose_state_layout, "x": 1.7,
              "eps": 1e-5, "log_atk_scale": c["las"]}
    chunk = dv.torch_chunk_precond_gated_delta_rule(q, k, c["v"], c["g_atk"], c["g"], c["beta_atk"], c["beta"],
                                                     **common)
    recurrent = dv.torch_fused_recurrent_precond_gated_delta_rule(
        q, k, c["v"], g=c["g"], beta=c["beta"], g_atk=c["g_atk"], beta_atk=c["beta_atk"], **common)
    for o, ht, at in (chunk, recurrent):
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(ht, ht_ref.transpose(-1, -2) if transpose_state_layout else ht_ref, **TOL)
        torch.testing.assert_close(at, at_ref, **TOL)


def test_precond_gated_delta_rule_in_kernel_l2norm():
    c = precond_case(T=70)
    args = (c["v"], c["g_atk"], c["g"], c["beta_atk"], c["beta"])
    states = {"initial_state": c["h0"], "initial_A_state": c["A0"], "output_final_state": True}
    fused = dv.torch_chunk_precond_gated_delta_rule(c["q"], c["k"], *args, **states)
    given = dv.torch_chunk_precond_gated_delta_rule(l2(c["q"]), l2(c["k"]), *args, **states,
                                                    use_qk_l2norm_in_kernel=False)
    recurrent = dv.torch_fused_recurrent_precond_gated_delta_rule(
        c["q"], c["k"], c["v"], g=c["g"], beta=c["beta"], g_atk=c["g_atk"], beta_atk=c["beta_atk"], **states)
    for a, b in zip(fused, given):
        torch.testing.assert_close(a, b, **TOL)
    for a, b in zip(fused, recurrent):
        torch.testing.assert_close(a, b, **TOL)
    _, ht, at = dv.torch_chunk_precond_gated_delta_rule(c["q"], c["k"], *args)
    assert ht is None and at is None


@pytest.mark.parametrize("gate", ["given", "in_kernel", "in_kernel_lower_bound"])
def test_precond_kda_matches_fla_naive(gate):
    from fla.ops.precond_kda.naive import naive_recurrent_precond_kda as naive

    c = precond_case(HV=2)
    raw, A_log, dt_bias = randn(2, 150, 2, 8), torch.log(torch.rand(2, dtype=F64) * 15 + 1), randn(16) - 2
    lower_bound = -5.0 if gate == "in_kernel_lower_bound" else None
    decay = F.logsigmoid(raw) if gate == "given" else kda_gate_reference(raw, A_log, dt_bias, lower_bound)
    g = decay if gate == "given" else raw
    gate_args = {} if gate == "given" else {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias,
                                            "lower_bound": lower_bound}
    # fla's chunk_precond_kda always l2-normalises q and k; its reference takes them as given
    o_ref, ht_ref, at_ref = in_float64(naive)(
        l2(c["q"]), l2(c["k"]), c["v"], decay, c["g_atk"], c["beta_atk"], c["beta"], initial_state=c["h0"],
        initial_A_state=c["A0"], output_final_state=True, log_atk_scale=c["las"])
    args = (c["q"], c["k"], c["v"], g, c["g_atk"], c["beta_atk"], c["beta"])
    states = {"initial_state": c["h0"], "initial_A_state": c["A0"], "output_final_state": True,
              "log_atk_scale": c["las"]}
    for op in (dv.torch_chunk_precond_kda, dv.torch_fused_recurrent_precond_kda):
        o, ht, at = op(*args, **states, **gate_args)
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(ht, ht_ref, **TOL)
        torch.testing.assert_close(at, at_ref, **TOL)


def test_fused_recurrent_precond_kda_gva_keeps_one_atk_statistic_per_value_head():
    # fla's recurrent kernel reads q/k per key head, everything else (ATK included) per value head
    c = precond_case(T=30, H=1, HV=2)
    g = F.logsigmoid(randn(2, 30, 2, 8))
    g_atk, beta_atk, A0 = F.logsigmoid(randn(2, 30, 2)), torch.rand(2, 30, 2, dtype=F64), torch.rand(2, 2, 8, dtype=F64)
    kwargs = {"initial_state": c["h0"], "initial_A_state": A0, "output_final_state": True}
    grouped = dv.torch_fused_recurrent_precond_kda(c["q"], c["k"], c["v"], g, g_atk, beta_atk, c["beta"], **kwargs)
    repeated = dv.torch_fused_recurrent_precond_kda(
        c["q"].repeat_interleave(2, 2), c["k"].repeat_interleave(2, 2), c["v"], g, g_atk, beta_atk, c["beta"],
        **kwargs)
    assert grouped[2].shape == (2, 2, 8)
    for a, b in zip(grouped, repeated):
        torch.testing.assert_close(a, b, **TOL)


# ---------------------------------------------------------------- shared properties


def _kda_call(op, c, **kw):
    return op(c["q"], c["k"], c["v"], c["gk"], c["beta"], use_qk_l2norm_in_kernel=True, **kw)


def _pgdn_call(op, c, **kw):
    if op is dv.torch_chunk_precond_gated_delta_rule:
        return op(c["q"], c["k"], c["v"], c["g_atk"], c["g"], c["beta_atk"], c["beta"], **kw)
    return op(c["q"], c["k"], c["v"], g=c["g"], beta=c["beta"], g_atk=c["g_atk"], beta_atk=c["beta_atk"], **kw)


def _pkda_call(op, c, **kw):
    return op(c["q"], c["k"], c["v"], c["gk"], c["g_atk"], c["beta_atk"], c["beta"], **kw)


def _delta_call(op, c, **kw):
    return op(c["q"], c["k"], c["v"], c["beta"], use_qk_l2norm_in_kernel=True, **kw)


VARLEN_OPS = {
    "chunk_delta_rule": (dv.torch_chunk_delta_rule, _delta_call),
    "fused_recurrent_delta_rule": (dv.torch_fused_recurrent_delta_rule, _delta_call),
    "chunk_kda": (dv.torch_chunk_kda, _kda_call),
    "fused_recurrent_kda": (dv.torch_fused_recurrent_kda, _kda_call),
    "chunk_precond_gated_delta_rule": (dv.torch_chunk_precond_gated_delta_rule, _pgdn_call),
    "fused_recurrent_precond_gated_delta_rule": (dv.torch_fused_recurrent_precond_gated_delta_rule, _pgdn_call),
    "chunk_precond_kda": (dv.torch_chunk_precond_kda, _pkda_call),
    "fused_recurrent_precond_kda": (dv.torch_fused_recurrent_precond_kda, _pkda_call),
}


@pytest.mark.parametrize("name", VARLEN_OPS)
def test_varlen_equals_separate_sequences(name):
    op, call = VARLEN_OPS[name]
    H = 2
    c = precond_case(B=1, T=110, H=H, HV=H)
    c["g"], c["gk"] = F.logsigmoid(randn(1, 110, H)), F.logsigmoid(randn(1, 110, H, 8))
    cu = torch.tensor([0, 3, 80, 110])
    h0, A0 = randn(3, H, 8, 6), torch.rand(3, H, 8, dtype=F64)
    extra = {"initial_A_state": A0} if "precond" in name else {}
    packed = call(op, c, initial_state=h0, output_final_state=True, cu_seqlens=cu, **extra)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {key: (t[:, a:b] if t.dim() > 1 and t.shape[1] == 110 else t) for key, t in c.items()}
        extra = {"initial_A_state": A0[i : i + 1]} if "precond" in name else {}
        alone = call(op, part, initial_state=h0[i : i + 1], output_final_state=True, **extra)
        torch.testing.assert_close(packed[0][:, a:b], alone[0], **TOL)
        for p, s in zip(packed[1:], alone[1:]):
            torch.testing.assert_close(p[i : i + 1], s, **TOL)


def test_strong_per_channel_decays_over_segments_stay_exact(monkeypatch):
    # several segments (state carried across) and decays far beyond exp's fp32 range within one chunk
    monkeypatch.setattr(fla_common, "SEGMENT_TOKENS", 128)
    c = precond_case(B=1, T=300, H=2, HV=2)
    g = -torch.rand(1, 300, 2, 8, dtype=F64) * 60  # down to exp(-60) per step and channel
    beta = torch.rand(1, 300, 2, dtype=F64)
    o_ref, ht_ref = dv.torch_fused_recurrent_kda(c["q"], c["k"], c["v"], g, beta, initial_state=c["h0"],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    low = [x.float() for x in (c["q"], c["k"], c["v"], g, beta, c["h0"])]
    o, ht = dv.torch_chunk_kda(*low[:5], initial_state=low[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all() and ht.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-4, atol=1e-4)


def test_chunk_grads_match_recurrent_grads(monkeypatch):
    monkeypatch.setattr(fla_common, "SEGMENT_TOKENS", 64)  # checkpointed segments in backward
    c = kda_case(B=1, T=100, H=1, HV=2, K=4, V=3)
    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0"]
    leaves = [c[n].requires_grad_() for n in names]
    w_o, w_h = randn(1, 100, 2, 3), randn(1, 2, 3, 4)
    flags = {"output_final_state": True, "use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True,
             "use_beta_sigmoid_in_kernel": True, "state_v_first": True}

    def grads(op):
        o, ht = op(c["q"], c["k"], c["v"], c["g"], c["beta"], A_log=c["A_log"], dt_bias=c["dt_bias"],
                   initial_state=c["h0"], **flags)
        return torch.autograd.grad((o * w_o).sum() + (ht * w_h).sum(), leaves)

    for mine, ref in zip(grads(dv.torch_chunk_kda), grads(dv.torch_fused_recurrent_kda)):
        torch.testing.assert_close(mine, ref, **TOL)
    p = precond_case(B=1, T=100, H=1, HV=2, K=4, V=3)
    names = ["q", "k", "v", "g", "beta", "g_atk", "beta_atk", "h0", "A0", "las"]
    leaves = [p[n].requires_grad_() for n in names]
    w_o, w_h, w_a = randn(1, 100, 2, 3), randn(1, 2, 4, 3), randn(1, 1, 4)

    def precond_grads(op):
        o, ht, at = _pgdn_call(op, p, initial_state=p["h0"], initial_A_state=p["A0"], output_final_state=True,
                               log_atk_scale=p["las"])
        return torch.autograd.grad((o * w_o).sum() + (ht * w_h).sum() + (at * w_a).sum(), leaves)

    for mine, ref in zip(precond_grads(dv.torch_chunk_precond_gated_delta_rule),
                         precond_grads(dv.torch_fused_recurrent_precond_gated_delta_rule)):
        torch.testing.assert_close(mine, ref, **TOL)


def test_dispatch_serves_the_names_the_layers_look_up():
    import fla.layers.delta_net
    import fla.layers.kda
    import fla.layers.precond_gated_deltanet
    import fla.layers.precond_kda

    layers = {
        fla.layers.delta_net: ("chunk_delta_rule", "fused_recurrent_delta_rule"),
        fla.layers.kda: ("chunk_kda", "fused_recurrent_kda"),
        fla.layers.precond_gated_deltanet: ("chunk_precond_gated_delta_rule",
                                            "fused_recurrent_precond_gated_delta_rule"),
        fla.layers.precond_kda: ("fused_kda_gate", "chunk_precond_kda", "fused_recurrent_precond_kda"),
    }
    served = [name for names in layers.values() for name in names]
    assert sorted(served) == sorted(dv.OPS)
    for layer, names in layers.items():
        for name in names:
            assert dispatch.OPS[name] is dv.OPS[name]
            assert getattr(layer, name) is dispatch.fla_original(name)
    # through the dispatcher: positional arguments, A_log / dt_bias from fla's **kwargs, CUDA-only ones refused
    c = kda_case(T=20)
    flags = {"use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True, "output_final_state": True}
    gates = {"A_log": c["A_log"], "dt_bias": c["dt_bias"]}
    dispatched = dispatch.dispatcher("chunk_kda")(c["q"], c["k"], c["v"], c["g"], c["beta"], **flags, **gates)
    direct = dv.torch_chunk_kda(c["q"], c["k"], c["v"], c["g"], c["beta"], **flags, **gates)
    for a, b in zip(dispatched, direct):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="cp_context"):
        dispatch.dispatcher("chunk_kda")(c["q"], c["k"], c["v"], c["g"], c["beta"], cp_context=object())


def test_clear_errors_and_the_deprecated_layout_name():
    c = kda_case(T=5)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"])
    with pytest.raises(ValueError, match="A_log"):
        dv.torch_chunk_kda(*args, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="lower_bound"):
        dv.torch_chunk_kda(*args, use_gate_in_kernel=True, safe_gate=True, A_log=c["A_log"])
    with pytest.raises(NotImplementedError, match="return_intermediate_states"):
        dv.torch_chunk_kda(*args, return_intermediate_states=True)
    with pytest.raises(ValueError, match="g_atk"):
        dv.torch_fused_recurrent_precond_gated_delta_rule(c["q"], c["k"], c["v"])
    v_first = dv.torch_chunk_kda(*args, initial_state=c["h0"], output_final_state=True, state_v_first=True)
    renamed = dv.torch_chunk_kda(*args, initial_state=c["h0"], output_final_state=True, transpose_state_layout=True)
    for a, b in zip(v_first, renamed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- tiny models

VOCAB = 256
FAMILIES = {
    "delta_net": {"num_heads": 2},
    "delta_net_elu_sum_gate": {"num_heads": 2, "qk_activation": "elu", "qk_norm": "sum", "use_gate": True},
    "kda": {"num_heads": 2, "head_dim": 16},
    "kda_gva_neg_eig_lower_bound": {"num_heads": 2, "num_v_heads": 4, "head_dim": 16, "allow_neg_eigval": True,
                                    "safe_gate": True, "lower_bound": -5.0},
    "precond_gated_deltanet": {"num_heads": 2, "head_dim": 16},
    "precond_gated_deltanet_gva": {"num_heads": 2, "num_v_heads": 4, "head_dim": 16, "use_gate": False},
    "precond_kda": {"num_heads": 2, "head_dim": 16},
    "precond_kda_gva_lower_bound": {"num_heads": 2, "num_v_heads": 4, "head_dim": 16, "safe_gate": True,
                                    "lower_bound": -5.0},
}
BASE = ["delta_net", "kda", "precond_gated_deltanet", "precond_kda"]


def tiny_model(name):
    model_type = next(base for base in sorted(BASE, key=len, reverse=True) if name.startswith(base))
    config = AutoConfig.for_model(
        model_type, hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, intermediate_size=128,
        fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False, **FAMILIES[name])
    return fla_cpu.use_torch_backend(AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_then_chunked_prefill_and_decode_equal_full_forward(name):
    model = tiny_model(name).double().eval()
    ids = torch.randint(0, VOCAB, (2, 160))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    assert torch.isfinite(full).all()
    logits, _ = prefill_then_decode(model, ids)
    torch.testing.assert_close(logits, full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", BASE)
def test_training_step_gives_finite_grads(name):
    model = tiny_model(name).train()
    ids = torch.randint(0, VOCAB, (2, 100))
    out = model(ids, labels=ids)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", ["kda", "precond_gated_deltanet", "precond_kda"])
def test_decode_with_autograd_enabled_matches_no_grad(name):
    # with grad on these layers run the chunk op even for one token
    model = tiny_model(name).double().eval()
    ids = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    cache = Cache()
    model(ids[:, :39], past_key_values=cache, use_cache=True)
    last = model(ids[:, 39:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", BASE)
def test_left_padded_batch_matches_unpadded_sequences(name):
    # an attention mask makes fla pack the sequences (cu_seqlens): the ops must respect the bounds
    model = tiny_model(name).double().eval()
    seqs = [torch.randint(1, VOCAB, (n,)) for n in (90, 30)]
    ids, mask = torch.zeros(2, 90, dtype=torch.long), torch.zeros(2, 90, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, 90 - len(s) :], mask[i, 90 - len(s) :] = s, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, use_cache=False).logits
        for i, s in enumerate(seqs):
            alone = model(s[None], use_cache=False).logits[0]
            torch.testing.assert_close(batched[i, 90 - len(s) :], alone, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", BASE)
def test_bfloat16_model_tracks_float32(name):
    model = tiny_model(name).eval()
    ids = torch.randint(0, VOCAB, (1, 150))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        model.bfloat16()
        cache = Cache()
        low = torch.cat([model(ids[:, :100], past_key_values=cache, use_cache=True).logits,
                         model(ids[:, 100:], past_key_values=cache, use_cache=True).logits], 1)
    assert low.dtype == torch.bfloat16
    err = (low.float() - reference).norm() / reference.norm()
    assert err < 2e-2, f"bf16 logits deviate from fp32 by {err:.3e} (relative)"


@pytest.mark.slow
@pytest.mark.parametrize("name", BASE)
def test_long_forward_is_fast_and_finite(name):
    model = tiny_model(name).eval()
    ids = torch.randint(0, VOCAB, (1, 20_000))
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(ids, use_cache=False, logits_to_keep=1).logits
    elapsed = time.perf_counter() - start
    assert torch.isfinite(logits).all()
    # about 3-4 s on a 2-core CPU; the bound only catches an accidentally quadratic or per-token path
    assert elapsed < 60, f"20K-token forward took {elapsed:.1f}s"


# ---------------------------------------------------------------- against fla's kernels (CUDA)

def cuda_randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda").to(dtype)


def assert_near_kernel(mine, theirs, tolerance=5e-3):
    """Relative to the norm: fla's fp32 kernels use tf32 products, bf16 ones round their inputs."""
    assert mine.shape == theirs.shape and torch.isfinite(mine).all()
    err = ((mine.double() - theirs.double()).norm() / theirs.double().norm()).item()
    assert err < tolerance, f"relative error {err:.2e}"


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's triton kernels")
def test_kda_and_delta_rule_follow_fla_kernels(lower_bound, allow_neg_eigval):
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from fla.ops.kda.gate import fused_kda_gate

    B, T, H, HV, K, V = 2, 300, 2, 4, 64, 64
    q, k, v = cuda_randn(B, T, H, K), cuda_randn(B, T, H, K), cuda_randn(B, T, HV, V)
    g, beta, h0 = cuda_randn(B, T, HV, K), cuda_randn(B, T, HV), cuda_randn(B, HV, V, K)
    A_log = torch.log(torch.rand(HV, device="cuda") * 15 + 1)
    dt_bias = cuda_randn(HV * K) - 2
    flags = {"initial_state": h0, "output_final_state": True, "use_qk_l2norm_in_kernel": True,
             "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": allow_neg_eigval,
             "lower_bound": lower_bound, "state_v_first": True, "A_log": A_log, "dt_bias": dt_bias}
    for fla_op, torch_op, length, extra in (
        (chunk_kda, dv.torch_chunk_kda, T, {"safe_gate": lower_bound is not None}),
        (fused_recurrent_kda, dv.torch_fused_recurrent_kda, 40, {}),
    ):
        args = [x[:, :length] for x in (q, k, v, g, beta)]
        for mine, theirs in zip(torch_op(*args, **flags, **extra), fla_op(*args, **flags, **extra)):
            assert_near_kernel(mine, theirs)
    torch.testing.assert_close(dv.torch_fused_kda_gate(g, A_log, dt_bias, lower_bound),
                               fused_kda_gate(g, A_log, dt_bias, lower_bound), rtol=1e-4, atol=1e-4)
    # DeltaNet: fla's chunk kernel takes half precision only
    vd, bd, hd = cuda_randn(B, T, H, V), torch.rand(B, T, H, device="cuda"), cuda_randn(B, H, K, V)
    for fla_op, torch_op, length, dtype in ((chunk_delta_rule, dv.torch_chunk_delta_rule, T, torch.bfloat16),
                                            (fused_recurrent_delta_rule, dv.torch_fused_recurrent_delta_rule, 40,
                                             torch.float32)):
        args = [x[:, :length].to(dtype) for x in (q, k, vd)] + [bd[:, :length].to(dtype)]
        kwargs = {"initial_state": hd, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
        for mine, theirs in zip(torch_op(*args, **kwargs), fla_op(*args, **kwargs)):
            assert mine.dtype == theirs.dtype
            assert_near_kernel(mine, theirs, 3e-2 if dtype == torch.bfloat16 else 5e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's triton kernels")
def test_preconditioned_ops_follow_fla_kernels():
    from fla.ops.kda.gate import fused_kda_gate
    from fla.ops.precond_gated_delta_rule import (
        chunk_precond_gated_delta_rule,
        fused_recurrent_precond_gated_delta_rule,
    )
    from fla.ops.precond_kda import chunk_precond_kda, fused_recurrent_precond_kda

    B, T, H, HV, K, V = 2, 300, 2, 4, 64, 64
    q, k, v = cuda_randn(B, T, H, K), cuda_randn(B, T, H, K), cuda_randn(B, T, HV, V)
    g, beta = F.logsigmoid(cuda_randn(B, T, HV)) / 4, torch.rand(B, T, HV, device="cuda")
    g_atk, beta_atk = F.logsigmoid(cuda_randn(B, T, H)), torch.rand(B, T, H, device="cuda")
    h0, A0, las = cuda_randn(B, HV, V, K), torch.rand(B, H, K, device="cuda"), cuda_randn(H) * 0.5 - 0.2
    common = {"initial_state": h0, "initial_A_state": A0, "output_final_state": True, "transpose_state_layout": True,
              "x": 1.5, "eps": 1e-6, "log_atk_scale": las}
    args = (q, k, v, g_atk, g, beta_atk, beta)
    for mine, theirs in zip(dv.torch_chunk_precond_gated_delta_rule(*args, **common),
                            chunk_precond_gated_delta_rule(*args, **common)):
        assert_near_kernel(mine, theirs)
    short = {"q": q[:, :40], "k": k[:, :40], "v": v[:, :40], "g": g[:, :40], "beta": beta[:, :40],
             "g_atk": g_atk[:, :40], "beta_atk": beta_atk[:, :40]}
    for mine, theirs in zip(dv.torch_fused_recurrent_precond_gated_delta_rule(**short, **common),
                            fused_recurrent_precond_gated_delta_rule(**short, **common)):
        assert_near_kernel(mine, theirs)
    # PrecondKDA: its layer repeats q / k over the value heads and gates with fused_kda_gate first
    qr, kr = q.repeat_interleave(2, 2), k.repeat_interleave(2, 2)
    raw, A_log, dt_bias = cuda_randn(B, T, HV, K), torch.log(torch.rand(HV, device="cuda") * 15 + 1), cuda_randn(HV * K)
    g_atk4, beta_atk4 = F.logsigmoid(cuda_randn(B, T, HV)), torch.rand(B, T, HV, device="cuda")
    A04, las4 = torch.rand(B, HV, K, device="cuda"), cuda_randn(HV) * 0.5 - 0.2
    decay = fused_kda_gate(raw, A_log, dt_bias)
    common.update(initial_A_state=A04, log_atk_scale=las4)
    for gate, extra in ((decay, {}), (raw, {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias})):
        args = (qr, kr, v, gate, g_atk4, beta_atk4, beta)
        for mine, theirs in zip(dv.torch_chunk_precond_kda(*args, **common, **extra),
                                chunk_precond_kda(*args, **common, **extra)):
            assert_near_kernel(mine, theirs)
    # the recurrent kernel itself reads q / k per key head, the rest per value head
    args = (q[:, :40], k[:, :40], v[:, :40], raw[:, :40], g_atk4[:, :40], beta_atk4[:, :40], beta[:, :40])
    extra = {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias}
    for mine, theirs in zip(dv.torch_fused_recurrent_precond_kda(*args, **common, **extra),
                            fused_recurrent_precond_kda(*args, **common, **extra)):
        assert_near_kernel(mine, theirs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's triton kernels")
def test_preconditioned_gated_delta_rule_backward_on_cuda_follows_torch():
    """The op the dispatcher serves on CUDA (fla's; on a Hopper machine hit by fla #640, fla's with the torch
    chunk_bwd_dqkwg in its backward) has the torch version's gradients: what training on the GPU uses."""
    B, T, H, K, V = 2, 200, 2, 64, 64
    inputs = {"q": cuda_randn(B, T, H, K), "k": F.normalize(cuda_randn(B, T, H, K), dim=-1),
              "v": cuda_randn(B, T, H, V), "g_atk": F.logsigmoid(cuda_randn(B, T, H)),
              "g": F.logsigmoid(cuda_randn(B, T, H)) / 4, "beta_atk": torch.rand(B, T, H, device="cuda"),
              "beta": torch.rand(B, T, H, device="cuda")}
    upstream = cuda_randn(B, T, H, V)
    grads = []
    for op in (dispatch.dispatcher("chunk_precond_gated_delta_rule"), dv.torch_chunk_precond_gated_delta_rule):
        leaves = {name: x.clone().requires_grad_() for name, x in inputs.items()}
        output = op(**leaves, x=1.5, eps=1e-6)[0]
        (output * upstream).sum().backward()
        grads.append({name: x.grad for name, x in leaves.items()})
    for name in inputs:
        assert_near_kernel(grads[0][name], grads[1][name], 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's triton kernels")
def test_delta_rule_under_autocast_takes_float32_inputs_in_the_autocast_dtype():
    """fla's chunk_delta_rule refuses float32; under autocast (training with float32 master weights) the
    dispatcher hands it the autocast dtype, as autocast does for a matmul."""
    from fla.ops.delta_rule import chunk_delta_rule

    B, T, H, K = 2, 130, 2, 64
    q, k, v = cuda_randn(B, T, H, K), F.normalize(cuda_randn(B, T, H, K), dim=-1), cuda_randn(B, T, H, K)
    beta = torch.rand(B, T, H, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        served, _ = dispatch.dispatcher("chunk_delta_rule")(q, k, v, beta)
    expected, _ = chunk_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16())
    assert torch.equal(served, expected)
