"""fla's RWKV7 on CPU through ccq_eval.model.fla_cpu (rwkv7.py): the recurrence against a naive per-token
reference written here (and fla's own naive DPLR recurrence), the layer's helper ops against fla's torch
references, and a tiny RWKV7 model (fla's classes) end to end: forward / backward, chunked prefill + decode
against one full forward, padded batches, long inputs.

Ops are called by their fla names through the dispatchers, with the arguments fla's layer passes, so the
binding against fla's signatures is tested too. T is never a multiple of the chunk size.
"""

import time

import fla.models  # noqa: F401  (registers fla's configs with transformers' Auto classes)
import pytest
import torch
import torch.nn.functional as F
from cache_support import prefill_then_decode
from fla.models.utils import Cache
from fla.modules.norm.layernorm import group_norm_ref, layer_norm_ref
from fla.modules.token_shift import token_shift_ref
from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence
from fla.ops.rwkv7.fused_addcmul import torch_addcmul_rwkv7
from fla.ops.rwkv7.fused_k_update import k_update_ref
from fla.ops.rwkv7.gate_output_correction import gate_output_correction_ref
from transformers import AutoConfig, AutoModelForCausalLM

from ccq_eval.model import fla_cpu
from ccq_eval.model.fla_cpu import common as fla_common
from ccq_eval.model.fla_cpu import dispatch
from ccq_eval.model.fla_cpu import rwkv7 as fla_rwkv7

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
LOWER_BOUND = -0.6065306597126334  # RWKV7's w = LOWER_BOUND * sigmoid(.)
VOCAB = 256


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def op(name):
    return dispatch.dispatcher(name)


def rwkv7_inputs(B, T, H, K, V, dtype=F64, decay_scale=1.0):
    """Inputs shaped as the layer makes them: kk unit-norm, a in (0, 1), w in [LOWER_BOUND, 0) * decay_scale."""
    r, k = torch.randn(B, T, H, K, dtype=dtype), torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, H, V, dtype=dtype)
    kk = F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
    a = torch.rand(B, T, H, K, dtype=dtype)
    w = LOWER_BOUND * torch.rand(B, T, H, K, dtype=dtype) * decay_scale
    return r, w, k, v, kk, a


def naive_rwkv7(r, w, k, v, a, b, scale, h0=None, reverse=False):
    """The definition token by token, V-first state S [V, K]: S <- S (diag(exp w) + a b^T) + v k^T,
    o = S (scale r). h0 and the returned state are K-first [B, H, K, V] (fla's layout)."""
    B, T, H, K = r.shape
    S = torch.zeros(B, H, v.shape[-1], K, dtype=F64) if h0 is None else h0.transpose(-1, -2).clone()
    o = torch.empty(B, T, H, v.shape[-1], dtype=F64)
    for t in reversed(range(T)) if reverse else range(T):
        transition = torch.diag_embed(w[:, t].exp()) + a[:, t, ..., :, None] * b[:, t, ..., None, :]
        S = S @ transition + v[:, t, ..., :, None] * k[:, t, ..., None, :]
        o[:, t] = (S @ (scale * r[:, t])[..., None]).squeeze(-1)
    return o, S.transpose(-1, -2)


@pytest.fixture(params=["factored", "sub_blocks"])
def score_path(request, monkeypatch):
    """Run the chunk form both ways: one factorised matmul per chunk, and the exponent-<=-0 sub-blocks."""
    if request.param == "sub_blocks":
        monkeypatch.setattr(fla_rwkv7, "FACTOR_SPREAD", {})
    return request.param


def test_dispatch_serves_the_names_the_rwkv7_modules_look_up():
    import fla.layers.rwkv7
    import fla.models.rwkv7.modeling_rwkv7

    layer_names = ("chunk_rwkv7", "fused_mul_recurrent_rwkv7", "fused_addcmul_rwkv7", "fused_k_rwkv7",
                   "gate_output_correction", "token_shift", "l2_norm")
    for name in layer_names:
        assert dispatch.OPS[name] is fla_rwkv7.OPS[name]
        assert getattr(fla.layers.rwkv7, name) is dispatch.fla_original(name)
    assert fla.models.rwkv7.modeling_rwkv7.token_shift is dispatch.fla_original("token_shift")
    assert sorted(fla_rwkv7.OPS) == sorted([*layer_names, "fused_recurrent_rwkv7"])


# ---------------------------------------------------------------- the recurrence


@pytest.mark.parametrize("T", [1, 37, 150])
def test_chunk_and_recurrent_forms_match_the_naive_recurrence(T, score_path):
    B, H, K, V = 2, 3, 16, 8
    r, w, k, v, kk, a = rwkv7_inputs(B, T, H, K, V)
    h0 = torch.randn(B, H, K, V, dtype=F64)
    o_ref, ht_ref = naive_rwkv7(r, w, k, v, -kk, kk * a, 1.0, h0)
    # chunk_rwkv7 as the layer calls it
    o, ht = op("chunk_rwkv7")(r=r, w=w, k=k, v=v, a=-kk, b=kk * a, scale=1.0, initial_state=h0,
                              output_final_state=True, cu_seqlens=None, safe_gate=True,
                              lower_bound=LOWER_BOUND, chunk_size=64)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)
    o, ht = op("fused_mul_recurrent_rwkv7")(r=r, w=w, k=k, v=v, kk=kk, a=a, scale=1.0, initial_state=h0,
                                            output_final_state=True, cu_seqlens=None)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)
    o, ht = op("fused_recurrent_rwkv7")(r, w, k, v, -kk, kk * a, scale=1.0, initial_state=h0)  # fla: final state on
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


def test_generic_low_rank_factors_scale_and_no_initial_state(score_path):
    # a, b unrelated to each other (the general DPLR rule), fla's default scale K^-0.5 where scale=None
    B, T, H, K, V = 1, 100, 2, 8, 4
    r, w, k, v, _, _ = rwkv7_inputs(B, T, H, K, V)
    a, b = 0.3 * torch.randn(B, T, H, K, dtype=F64), 0.3 * torch.randn(B, T, H, K, dtype=F64)
    o_ref, ht_ref = naive_rwkv7(r, w, k, v, a, b, K**-0.5)
    for name in ("chunk_rwkv7", "fused_recurrent_rwkv7"):
        o, ht = op(name)(r, w, k, v, a, b, scale=None, output_final_state=True)
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(ht, ht_ref, **TOL)
    o, ht = op("chunk_rwkv7")(r, w, k, v, a, b)
    torch.testing.assert_close(o, naive_rwkv7(r, w, k, v, a, b, 1.0)[0], **TOL)  # chunk_rwkv7's default scale 1
    assert ht is None


def test_fla_naive_dplr_recurrence_agrees():
    # fla's own reference (float32 inside, scale fixed at K^-0.5, head-first layout)
    B, T, H, K, V = 2, 75, 2, 16, 16
    r, w, k, v, kk, a = rwkv7_inputs(B, T, H, K, V)
    h0 = torch.randn(B, H, K, V, dtype=F64)
    o, ht = op("chunk_rwkv7")(r, w, k, v, -kk, kk * a, scale=K**-0.5, initial_state=h0, output_final_state=True)
    heads_first = [x.transpose(1, 2).float() for x in (r, k, v, -kk, kk * a, w)]
    o_fla, ht_fla = dplr_recurrence(*heads_first, initial_state=h0.float())
    torch.testing.assert_close(o, o_fla.transpose(1, 2).double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht, ht_fla.double(), rtol=1e-4, atol=1e-4)


def test_strong_decays_stay_finite_and_exact_in_float32():
    # per-step decays down to exp(-30): far beyond the factorised form's range, the sub-blocks take over
    B, T, H, K, V = 1, 200, 2, 16, 8
    r, w, k, v, kk, a = rwkv7_inputs(B, T, H, K, V, decay_scale=50.0)
    h0 = torch.randn(B, H, K, V, dtype=F64)
    o_ref, ht_ref = naive_rwkv7(r, w, k, v, -kk, kk * a, 1.0, h0)
    o, ht = op("chunk_rwkv7")(r, w, k, v, -kk, kk * a, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)
    o, ht = op("chunk_rwkv7")(*(x.float() for x in (r, w, k, v, -kk, kk * a)), initial_state=h0.float(),
                              output_final_state=True)
    assert torch.isfinite(o).all() and o.dtype == torch.float32 and ht.dtype == torch.float32
    assert (o.double() - o_ref).abs().max() < 1e-4 * o_ref.abs().max()
    assert (ht.double() - ht_ref).abs().max() < 1e-4 * ht_ref.abs().max()


def test_segments_carry_the_state(monkeypatch):
    monkeypatch.setattr(fla_common, "SEGMENT_TOKENS", 128)
    B, T, H, K, V = 1, 300, 2, 8, 4
    r, w, k, v, kk, a = rwkv7_inputs(B, T, H, K, V)
    o_ref, ht_ref = naive_rwkv7(r, w, k, v, -kk, kk * a, 1.0)
    o, ht = op("chunk_rwkv7")(r, w, k, v, -kk, kk * a, output_final_state=True)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


def test_varlen_and_reverse():
    H, K, V = 2, 8, 4
    cu_seqlens = torch.tensor([0, 5, 5, 70, 133])  # one empty sequence
    N, total = len(cu_seqlens) - 1, int(cu_seqlens[-1])
    r, w, k, v, kk, a = rwkv7_inputs(1, total, H, K, V)
    h0 = torch.randn(N, H, K, V, dtype=F64)
    for reverse in (False, True):
        o_ref, ht_ref = torch.zeros(1, total, H, V, dtype=F64), torch.empty(N, H, K, V, dtype=F64)
        for i in range(N):
            s = slice(int(cu_seqlens[i]), int(cu_seqlens[i + 1]))
            o_i, ht_ref[i : i + 1] = naive_rwkv7(r[:, s], w[:, s], k[:, s], v[:, s], -kk[:, s], kk[:, s] * a[:, s],
                                                 1.0, h0[i : i + 1], reverse=reverse)
            o_ref[:, s] = o_i
        o, ht = op("fused_mul_recurrent_rwkv7")(r, w, k, v, kk, a, initial_state=h0, output_final_state=True,
                                                reverse=reverse, cu_seqlens=cu_seqlens)
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(ht, ht_ref, **TOL)
        if not reverse:
            o, ht = op("chunk_rwkv7")(r, w, k, v, -kk, kk * a, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens)
            torch.testing.assert_close(o, o_ref, **TOL)
            torch.testing.assert_close(ht, ht_ref, **TOL)


def test_dtypes_of_outputs_and_states():
    r, w, k, v, kk, a = rwkv7_inputs(1, 20, 2, 8, 4, dtype=torch.bfloat16)
    o, ht = op("chunk_rwkv7")(r, w, k, v, -kk, kk * a, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    o, ht = op("fused_mul_recurrent_rwkv7")(r, w, k, v, kk, a, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    with pytest.raises(NotImplementedError, match="CUDA-only"):
        op("chunk_rwkv7")(r, w, k, v, -kk, kk * a, cp_context=object())


def test_autograd_through_the_chunk_form_matches_the_recurrent_form(score_path):
    B, T, H, K, V = 1, 70, 2, 8, 4
    inputs = [x.requires_grad_() for x in rwkv7_inputs(B, T, H, K, V)]
    r, w, k, v, kk, a = inputs
    h0 = torch.randn(B, H, K, V, dtype=F64, requires_grad=True)
    weights = torch.randn(B, T, H, V, dtype=F64)
    grads = []
    for name in ("chunk_rwkv7", "fused_recurrent_rwkv7"):
        o, ht = op(name)(r, w, k, v, -kk, kk * a, scale=1.0, initial_state=h0, output_final_state=True)
        grads.append(torch.autograd.grad((o * weights).sum() + ht.square().sum(), [*inputs, h0]))
    for g_chunk, g_steps in zip(*grads, strict=True):
        torch.testing.assert_close(g_chunk, g_steps, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- the layer's helper ops


def test_token_shift_matches_fla_reference_and_carries_its_cache():
    x = torch.randn(2, 9, 6, dtype=F64)
    torch.testing.assert_close(op("token_shift")(x), token_shift_ref(x), rtol=0, atol=0)
    delta, last = op("token_shift")(x, None, output_cache=True)
    torch.testing.assert_close(last, x[:, -1])
    first, cache = op("token_shift")(x[:, :4], output_cache=True)
    rest, cache = op("token_shift")(x[:, 4:], cache=cache, output_cache=True, chunk_indices=None)
    torch.testing.assert_close(torch.cat([first, rest], 1), delta, rtol=0, atol=0)
    step, _ = op("token_shift")(x[:, 4:5], cache=x[:, 3], output_cache=True)  # one-token decode
    torch.testing.assert_close(step, delta[:, 4:5], rtol=0, atol=0)
    packed = torch.randn(1, 12, 6, dtype=F64)
    cu_seqlens = torch.tensor([0, 1, 5, 5, 12])
    torch.testing.assert_close(op("token_shift")(packed, cu_seqlens), token_shift_ref(packed, cu_seqlens))
    previous = torch.randn(4, 6, dtype=F64)
    delta, last = op("token_shift")(packed, cu_seqlens, cache=previous, output_cache=True)
    torch.testing.assert_close(delta[0, [0, 1, 5]], previous[[0, 1, 3]] - packed[0, [0, 1, 5]])
    torch.testing.assert_close(last, torch.stack([packed[0, 0], packed[0, 4], previous[2], packed[0, 11]]))


def test_addcmul_k_update_gate_correction_and_l2_norm_match_fla_references():
    B, T, H, D = 2, 7, 3, 8
    hidden, delta = torch.randn(B, T, H * D, dtype=F64), torch.randn(B, T, H * D, dtype=F64)
    mixes = [torch.randn(1, 1, H * D, dtype=F64) for _ in range(6)]
    for given in (mixes, mixes[:5]):
        ours = op("fused_addcmul_rwkv7")(hidden, delta, *given)
        for got, expected in zip(ours, torch_addcmul_rwkv7(hidden, delta, *given), strict=True):
            assert (got is None) == (expected is None)
            if got is not None:
                torch.testing.assert_close(got, expected, **TOL)
    k, a, ka = torch.randn(B, T, H * D, dtype=F64), torch.rand(B, T, H * D, dtype=F64), torch.randn(H * D, dtype=F64)
    torch.testing.assert_close(op("fused_k_rwkv7")(k, a, ka), k_update_ref(k, a, ka), **TOL)
    o, g = torch.randn(B, T, H * D, dtype=F64), torch.randn(B, T, H * D, dtype=F64)
    r, kh, v = (torch.randn(B, T, H, D, dtype=F64) for _ in range(3))
    r_k = torch.randn(H, D, dtype=F64)
    torch.testing.assert_close(op("gate_output_correction")(o, r, kh, r_k, v, g),
                               gate_output_correction_ref(o, r, kh, r_k, v, g), **TOL)
    x = torch.randn(B, T, H, D, dtype=torch.bfloat16)
    torch.testing.assert_close(op("l2_norm")(x).float(), F.normalize(x.float(), dim=-1), rtol=1e-2, atol=1e-2)
    assert op("l2_norm")(x).dtype == torch.bfloat16


def test_layer_norm_and_group_norm_modules_match_fla_references():
    from fla.modules import GroupNorm, LayerNorm

    x, residual = torch.randn(3, 5, 32, dtype=F64), torch.randn(3, 5, 32, dtype=F64)
    norm = fla_cpu.use_torch_backend(LayerNorm(32, bias=True).double())
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    torch.testing.assert_close(norm(x), layer_norm_ref(x, norm.weight, norm.bias, eps=norm.eps), **TOL)
    y, summed = norm(x, residual, True)
    y_ref, summed_ref = layer_norm_ref(x, norm.weight, norm.bias, residual, eps=norm.eps, prenorm=True)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(summed, summed_ref, **TOL)
    for is_rms_norm in (False, True):
        norm = fla_cpu.use_torch_backend(GroupNorm(4, 32, bias=True, eps=1e-3, is_rms_norm=is_rms_norm).double())
        with torch.no_grad():
            norm.weight.normal_()
            norm.bias.normal_()
        expected = group_norm_ref(x, norm.weight, norm.bias, 4, eps=1e-3, is_rms_norm=is_rms_norm)
        torch.testing.assert_close(norm(x), expected, **TOL)


# ---------------------------------------------------------------- a tiny RWKV7 model


def tiny_rwkv7(**overrides):
    config = {"hidden_size": 64, "num_hidden_layers": 2, "head_dim": 32, "vocab_size": VOCAB,
              "fuse_norm": False, "fuse_cross_entropy": False}
    config.update(overrides)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("rwkv7", **config))
    return fla_cpu.use_torch_backend(model)


@pytest.mark.parametrize("fuse_norm", [False, True])
def test_forward_loss_backward_finite(fuse_norm):
    model = tiny_rwkv7(fuse_norm=fuse_norm, fuse_cross_entropy=fuse_norm)
    model.train()
    ids = torch.randint(0, VOCAB, (2, 100))
    out = model(ids, labels=ids)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


@pytest.mark.parametrize("fuse_norm", [False, True])
def test_chunked_prefill_then_decode_equals_full_forward(fuse_norm):
    model = tiny_rwkv7(fuse_norm=fuse_norm).double().eval()
    ids = torch.randint(0, VOCAB, (2, 160))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    logits, cache = prefill_then_decode(model, ids)
    assert cache[0]["recurrent_state"].dtype == F64
    torch.testing.assert_close(logits, full, rtol=1e-9, atol=1e-9)


def test_decode_with_autograd_enabled_matches_no_grad():
    # with grad on, the layer runs the chunk form even for one token
    model = tiny_rwkv7().double().eval()
    ids = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    cache = Cache()
    model(ids[:, :39], past_key_values=cache, use_cache=True)
    last = model(ids[:, 39:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-9, atol=1e-9)


def test_left_padded_batch_matches_unpadded_sequences():
    model = tiny_rwkv7().double().eval()
    lengths = [90, 30]
    seqs = [torch.randint(1, VOCAB, (n,)) for n in lengths]
    T = max(lengths)
    ids, mask = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s) :] = s
        mask[i, T - len(s) :] = 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, use_cache=False).logits
        for i, s in enumerate(seqs):
            alone = model(s[None], use_cache=False).logits[0]
            torch.testing.assert_close(batched[i, T - len(s) :], alone, rtol=1e-9, atol=1e-9)


def test_bfloat16_model_tracks_float32():
    model = tiny_rwkv7().eval()
    ids = torch.randint(0, VOCAB, (1, 150))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        cache = Cache()
        model.bfloat16()
        low = torch.cat([model(ids[:, :100], past_key_values=cache, use_cache=True).logits,
                         model(ids[:, 100:], past_key_values=cache, use_cache=True).logits], 1)
    assert low.dtype == torch.bfloat16
    assert cache[0]["recurrent_state"].dtype == torch.float32
    err = (low.float() - reference).norm() / reference.norm()
    assert err < 2e-2, f"bf16 logits deviate from fp32 by {err:.3e} (relative)"


def test_long_forward_is_fast_and_finite():
    model = tiny_rwkv7(hidden_size=128, head_dim=64).eval()
    ids = torch.randint(0, VOCAB, (1, 20_000))
    start = time.perf_counter()
    with torch.no_grad():
        logits = model(ids, use_cache=False, logits_to_keep=1).logits
    elapsed = time.perf_counter() - start
    assert torch.isfinite(logits).all()
    # about 1 s on an idle 2-core CPU; the bound only catches an accidentally quadratic or per-token path
    assert elapsed < 60, f"20K-token forward took {elapsed:.1f}s"
