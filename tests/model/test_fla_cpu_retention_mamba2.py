"""The CPU backend's RetNet, HGRN2 and Mamba2 pieces (fla_cpu/retention.py, fla_cpu/mamba2.py).

Ops, called through the dispatchers fla's layers get, against fla's own references where fla has them
(naive_retention, rotary_embedding_ref, the layernorm rms_norm_ref, layernorm_gated.rms_norm_ref, Mamba2's
token-by-token decode code) and against the formulas written out here in float64; T is never a multiple of
a chunk size. Then tiny random fla models of each family on CPU: loss and gradients, chunked prefill plus
decoding against one full forward, padded batches, bf16.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from cache_support import CHUNKED_PREFILL, prefill_then_decode
from fla.models.utils import Cache
from transformers import AutoConfig, AutoModelForCausalLM

from ccq_eval.model import fla_cpu
from ccq_eval.model.fla_cpu import dispatch

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
VOCAB = 128

chunk_retention = dispatch.dispatcher("chunk_retention")
fused_chunk_retention = dispatch.dispatcher("fused_chunk_retention")
fused_recurrent_retention = dispatch.dispatcher("fused_recurrent_retention")
parallel_retention = dispatch.dispatcher("parallel_retention")
rotary_embedding = dispatch.dispatcher("rotary_embedding")
rms_norm_linear = dispatch.dispatcher("rms_norm_linear")
rmsnorm_fn = dispatch.dispatcher("rmsnorm_fn")
layernorm_fn = dispatch.dispatcher("layernorm_fn")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def randn(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype)


# ---------------------------------------------------------------- retention


def retention_reference(q, k, v, scale, h0=None):
    """O(T^2) in float64: o_t = sum_{s<=t} gamma^(t-s) scale q_t.k_s v_s + gamma^(t+1) scale q_t h0, gamma_h =
    1 - 2^(-5-h); final state gamma^T h0 + sum_s gamma^(T-1-s) k_s v_s^T (K-first [B, H, K, V])."""
    T, H = q.shape[1:3]
    gamma = 1 - 2.0 ** (-5.0 - torch.arange(H, dtype=F64))
    t = torch.arange(T, dtype=F64)
    power = t[:, None] - t[None, :]
    decay = torch.where(power >= 0, gamma[:, None, None] ** power.clamp(min=0), 0.0)  # [H, t, s]
    attn = torch.einsum("bthk,bshk->bhts", q * scale, k) * decay
    o = torch.einsum("bhts,bshv->bthv", attn, v)
    final = torch.einsum("bshk,bshv,hs->bhkv", k, v, gamma[:, None] ** (T - 1 - t))
    if h0 is not None:
        o = o + torch.einsum("bthk,bhkv,ht->bthv", q * scale, h0, gamma[:, None] ** (t + 1))
        final = final + gamma[:, None, None] ** T * h0
    return o, final, attn


@pytest.mark.parametrize("T", [1, 37, 150])
def test_retention_ops_match_the_decay_formula(T):
    B, H, K, V = 2, 3, 16, 8
    q, k, v, h0 = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V), randn(B, H, K, V)
    o_ref, ht_ref, _ = retention_reference(q, k, v, K**-0.5, h0)
    for op in (chunk_retention, fused_chunk_retention, fused_recurrent_retention):
        o, ht = op(q, k, v, initial_state=h0, output_final_state=True)
        torch.testing.assert_close(o, o_ref, **TOL)
        torch.testing.assert_close(ht, ht_ref, **TOL)
        assert op(q, k, v, scale=0.5)[1] is None
    o, attn = parallel_retention(q, k, v, scale=0.5, output_attentions=True)
    o_ref, _, attn_ref = retention_reference(q, k, v, 0.5)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(attn, attn_ref, **TOL)
    assert parallel_retention(q, k, v)[1] is None


def test_retention_agrees_with_fla_naive_retention():
    from fla.ops.retention.naive import naive_retention

    B, T, H, K, V = 2, 100, 4, 16, 16
    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    # naive_retention is head-first and computes in float32 (whatever the input dtype)
    expected = naive_retention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    for op in (chunk_retention, fused_recurrent_retention, parallel_retention):
        torch.testing.assert_close(op(q, k, v)[0], expected, rtol=1e-5, atol=1e-5)


def test_fused_recurrent_retention_layouts_reverse_and_deprecated_name():
    B, T, H, K, V = 2, 30, 2, 8, 4
    q, k, v, h0 = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V), randn(B, H, K, V)
    o_ref, ht_ref, _ = retention_reference(q, k, v, K**-0.5, h0)
    o, ht = fused_recurrent_retention(
        q, k, v, initial_state=h0.transpose(-1, -2), output_final_state=True, state_v_first=True
    )
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref.transpose(-1, -2), **TOL)
    with pytest.warns(DeprecationWarning):
        o2, ht2 = fused_recurrent_retention(
            q, k, v, initial_state=h0.transpose(-1, -2), output_final_state=True, transpose_state_layout=True
        )
    torch.testing.assert_close(o2, o_ref, **TOL)
    torch.testing.assert_close(ht2, ht, **TOL)
    with pytest.raises(ValueError, match="state_v_first"):
        fused_recurrent_retention(q, k, v, state_v_first=True, transpose_state_layout=True)
    # reverse: the forward recurrence over time-flipped inputs, outputs flipped back
    o, ht = fused_recurrent_retention(q, k, v, initial_state=h0, output_final_state=True, reverse=True)
    flipped = [x.flip(1) for x in (q, k, v)]
    o_ref, ht_ref, _ = retention_reference(*flipped, K**-0.5, h0)
    torch.testing.assert_close(o, o_ref.flip(1), **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


def test_retention_varlen_equals_separate_sequences():
    H, K, V = 2, 8, 4
    lengths = [70, 1, 45]
    cu = torch.tensor([0, 70, 71, 116])
    q, k, v = randn(1, 116, H, K), randn(1, 116, H, K), randn(1, 116, H, V)
    h0 = randn(3, H, K, V)
    for op in (chunk_retention, fused_recurrent_retention):
        o, ht = op(q, k, v, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        for i in range(len(lengths)):
            a, b = int(cu[i]), int(cu[i + 1])
            o_ref, ht_ref, _ = retention_reference(q[:, a:b], k[:, a:b], v[:, a:b], K**-0.5, h0[i : i + 1])
            torch.testing.assert_close(o[:, a:b], o_ref, **TOL)
            torch.testing.assert_close(ht[i : i + 1], ht_ref, **TOL)
    o, _ = parallel_retention(q, k, v, cu_seqlens=cu)
    torch.testing.assert_close(o, chunk_retention(q, k, v, cu_seqlens=cu)[0], **TOL)
    with pytest.raises(ValueError, match="output_attentions"):
        parallel_retention(q, k, v, output_attentions=True, cu_seqlens=cu)


def test_retention_low_precision_computes_in_fp32():
    B, T, H, K, V = 1, 80, 2, 16, 16
    q, k, v = (randn(B, T, H, D).bfloat16() for D in (K, K, V))
    o_ref, ht_ref, _ = retention_reference(q.double(), k.double(), v.double(), K**-0.5)
    o, ht = chunk_retention(q, k, v, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    # the state is exact to fp32, the output to its bf16 rounding
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o.double(), o_ref, rtol=8e-3, atol=8e-3)


# ---------------------------------------------------------------- rotary embedding, rms_norm_linear


def rotary_tables(positions, R):
    freqs = torch.outer(torch.arange(positions, dtype=F64), 1.0 / 10000 ** (torch.arange(R, dtype=F64) / R))
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 10])
def test_rotary_embedding_matches_fla_reference(interleaved, rotary_dim):
    from fla.modules.rotary import rotary_embedding_ref

    B, T, H, D, offset = 2, 37, 3, 16, 5
    x = randn(B, T, H, D)
    cos, sin = rotary_tables(60, rotary_dim // 2)
    y = rotary_embedding(x, cos, sin, interleaved=interleaved, seqlen_offsets=offset)
    expected = rotary_embedding_ref(x, cos[offset : offset + T], sin[offset : offset + T], interleaved)
    torch.testing.assert_close(y, expected, **TOL)
    # one offset per sequence
    offsets = torch.tensor([0, 20])
    y = rotary_embedding(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    for b, off in enumerate(offsets.tolist()):
        expected = rotary_embedding_ref(x[b : b + 1], cos[off : off + T], sin[off : off + T], interleaved)
        torch.testing.assert_close(y[b : b + 1], expected, **TOL)
    # in place
    x_copy = x.clone()
    assert rotary_embedding(x_copy, cos, sin, interleaved=interleaved, inplace=True) is x_copy
    torch.testing.assert_close(x_copy, rotary_embedding(x, cos, sin, interleaved=interleaved), **TOL)


def test_rotary_embedding_packed_sequences_and_out_of_table_positions():
    from fla.modules.rotary import rotary_embedding_ref

    H, D = 2, 8
    cos, sin = rotary_tables(50, D // 2)
    cu = torch.tensor([0, 30, 31, 48])
    offsets = torch.tensor([3, 0, 10], dtype=torch.int32)
    x = randn(1, 48, H, D)
    y = rotary_embedding(x, cos, sin, seqlen_offsets=offsets, cu_seqlens=cu)
    for i in range(3):
        a, b, off = int(cu[i]), int(cu[i + 1]), int(offsets[i])
        expected = rotary_embedding_ref(x[:, a:b], cos[off : off + b - a], sin[off : off + b - a])
        torch.testing.assert_close(y[:, a:b], expected, **TOL)
    # positions outside the tables (a negative offset under left padding) are zero, as fla's kernel leaves them
    y = rotary_embedding(x[:, :10], cos, sin, seqlen_offsets=torch.tensor([-4]))
    assert (y[:, :4] == 0).all()
    torch.testing.assert_close(y[:, 4:], rotary_embedding_ref(x[:, 4:10], cos[:6], sin[:6]), **TOL)
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(x, cos, sin, seqlen_offsets=10)


def test_rotary_embedding_module_on_cpu():
    from fla.modules.rotary import RotaryEmbedding, rotary_embedding_ref

    module = fla_cpu.use_torch_backend(RotaryEmbedding(dim=16))
    q, k = randn(2, 20, 4, 16), randn(2, 20, 2, 16)
    q_rot, k_rot = module(q, k, seqlen_offset=7)
    cos, sin = module._cos_cached[7:27], module._sin_cached[7:27]
    torch.testing.assert_close(q_rot, rotary_embedding_ref(q, cos, sin), **TOL)
    torch.testing.assert_close(k_rot, rotary_embedding_ref(k, cos, sin), **TOL)


@pytest.mark.parametrize("prenorm", [False, True])
def test_rms_norm_linear_matches_fla_reference(prenorm):
    from fla.modules.layernorm import rms_norm_ref

    x, residual = randn(3, 7, 32), randn(3, 7, 32)
    norm_weight, norm_bias = randn(32), randn(32)
    linear_weight, linear_bias = randn(24, 32), randn(24)
    out = rms_norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, residual, eps=1e-6, prenorm=prenorm)
    y = rms_norm_ref(x, norm_weight, norm_bias, residual, eps=1e-6, prenorm=prenorm)
    y, summed = y if prenorm else (y, None)
    if prenorm:
        out, out_summed = out
        torch.testing.assert_close(out_summed, summed, **TOL)
    torch.testing.assert_close(out, F.linear(y, linear_weight, linear_bias), **TOL)
    out = rms_norm_linear(x, None, None, linear_weight, None)
    torch.testing.assert_close(out, F.linear(x * (x.square().mean(-1, keepdim=True) + 1e-5).rsqrt(), linear_weight))


# ---------------------------------------------------------------- gated norms, Mamba2


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("group_size", [None, 8])
def test_gated_norms_match_fla_reference(norm_before_gate, group_size):
    from fla.modules.layernorm_gated import RMSNormGated, rms_norm_ref

    x, z = randn(3, 5, 32), randn(3, 5, 32)
    weight = randn(32).float().double()  # fla's reference casts the weight to float32
    bias = randn(32).float().double()
    for b in (None, bias):
        y = rmsnorm_fn(x, weight, b, z, eps=1e-6, group_size=group_size, norm_before_gate=norm_before_gate)
        expected = rms_norm_ref(x, weight, b, z, 1e-6, group_size, norm_before_gate, upcast=False)
        torch.testing.assert_close(y, expected, **TOL)
    # LayerNorm form: fla has no reference, the formula per group
    y = layernorm_fn(x, weight, bias, z, eps=1e-6, group_size=group_size, norm_before_gate=norm_before_gate)
    gated = x if norm_before_gate else x * F.silu(z)
    g = group_size or 32
    expected = F.layer_norm(gated.reshape(3, 5, -1, g), (g,), eps=1e-6).reshape(3, 5, 32) * weight + bias
    expected = expected * F.silu(z) if norm_before_gate else expected
    torch.testing.assert_close(y, expected, **TOL)
    # the module (fla's forward code, our op) and low precision
    module = fla_cpu.use_torch_backend(RMSNormGated(32, eps=1e-6, group_size=group_size,
                                                    norm_before_gate=norm_before_gate)).double()
    module.weight.data.copy_(weight)
    torch.testing.assert_close(module(x, z), rms_norm_ref(x, weight, None, z, 1e-6, group_size, norm_before_gate,
                                                          upcast=False), **TOL)
    assert rmsnorm_fn(x.bfloat16(), weight.float(), None, z.bfloat16()).dtype == torch.bfloat16


def mamba2_layer(n_groups=1, **kwargs):
    from fla.layers.mamba2 import Mamba2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = Mamba2(num_heads=4, head_dim=16, hidden_size=32, state_size=8, expand=2, n_groups=n_groups,
                       layer_idx=0, chunk_size=32, **kwargs)
    with torch.no_grad():
        layer.conv1d.bias.normal_()  # nonzero, so that padding tokens would show through the convolution
    return fla_cpu.use_torch_backend(layer)


def fla_decode_reference(layer, x):
    """fla's own Mamba2 decode code (torch_forward with a state), token by token from zero states. fla computes
    A = -exp(A_log) in float32 there, so it is exact to ~1e-7 only."""
    fla_forward = type(layer).__bases__[0].torch_forward
    B = x.shape[0]
    state = {"conv_state": x.new_zeros(B, layer.conv_dim, layer.conv_kernel_size),
             "recurrent_state": x.new_zeros(B, layer.num_heads, layer.head_dim, layer.ssm_state_size)}
    outputs = []
    for t in range(x.shape[1]):
        out, state["conv_state"], state["recurrent_state"] = fla_forward(layer, x[:, t : t + 1], state, True)
        outputs.append(out)
    return torch.cat(outputs, 1), state["recurrent_state"]


@pytest.mark.parametrize("n_groups", [1, 2])
def test_mamba2_layer_matches_fla_decode_code(n_groups):
    layer = mamba2_layer(n_groups).double()
    x = randn(2, 45, 32)
    with torch.no_grad():
        cache = Cache()
        out, _, _ = layer(x, past_key_values=cache, use_cache=True)
        expected, expected_state = fla_decode_reference(layer, x)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[0]["recurrent_state"], expected_state, rtol=1e-6, atol=1e-6)
    # the cached convolution state is the last W inputs, as fla keeps it
    assert cache[0]["conv_state"].shape == (2, layer.conv_dim, layer.conv_kernel_size)


def test_mamba2_layer_matches_fla_torch_path_in_fp32():
    # fla's prefill code (the torch path it runs off CUDA, float32 inside) with one group, where it is right
    layer = mamba2_layer(D_has_hdim=True, norm_before_gate=True)
    x = randn(2, 45, 32, dtype=torch.float32)
    with torch.no_grad():
        out, _, _ = layer(x)
        expected, _, _ = type(layer).__bases__[0].torch_forward(layer, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_mamba2_layer_without_rmsnorm_and_refusals():
    layer = mamba2_layer(rmsnorm=False).double()
    x = randn(1, 20, 32)
    with torch.no_grad():
        cache = Cache()
        out = torch.cat([layer(x[:, :19], past_key_values=cache, use_cache=True)[0],
                         layer(x[:, 19:], past_key_values=cache, use_cache=True)[0]], 1)
        torch.testing.assert_close(out, layer(x)[0], **TOL)
        torch.testing.assert_close(out, fla_decode_reference(layer, x)[0], rtol=1e-6, atol=1e-6)
        # as fla: a cached state takes exactly one token per call; an empty input passes through
        with pytest.raises(ValueError, match="single new token"):
            layer(x[:, :2], past_key_values=cache, use_cache=True)
        assert layer(x[:, :0])[0].shape == (1, 0, 32)


# ---------------------------------------------------------------- tiny models


def tiny_model(model_type, **overrides):
    config = {
        "retnet": {"num_heads": 4},
        "hgrn2": {"expand_ratio": 32},
        # residual_in_fp32 would round the residual stream of the float64 model to float32
        "mamba2": {"expand": 2, "head_dim": 32, "num_heads": 4, "state_size": 16, "residual_in_fp32": False},
    }[model_type]
    config.update(fuse_norm=False, fuse_cross_entropy=False)
    if model_type != "mamba2":
        config.update(fuse_swiglu=False)
    config.update(overrides)
    config = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    return fla_cpu.use_torch_backend(model)


MODELS = {
    "retnet": lambda: tiny_model("retnet"),
    "retnet_fused": lambda: tiny_model("retnet", fuse_norm=True, fuse_swiglu=True),
    "retnet_gqa_feature_map": lambda: tiny_model("retnet", num_kv_heads=2, feature_map="relu"),
    "hgrn2": lambda: tiny_model("hgrn2"),
    "hgrn2_conv_no_lower_bound": lambda: tiny_model("hgrn2", expand_ratio=16, use_short_conv=True,
                                                    use_lower_bound=False, fuse_norm=True, fuse_swiglu=True),
    "mamba2": lambda: tiny_model("mamba2"),
    "mamba2_groups": lambda: tiny_model("mamba2", n_groups=2, fuse_norm=True),
}


@pytest.mark.parametrize("name", ["retnet", "hgrn2", "mamba2"])
def test_forward_loss_backward_finite(name):
    model = MODELS[name]().train()
    ids = torch.randint(0, VOCAB, (2, 90))
    out = model(ids, labels=ids)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", MODELS)
def test_prefill_then_decode_equals_full_forward(name):
    model = MODELS[name]().double().eval()
    ids = torch.randint(0, VOCAB, (2, 160))
    # RetNet / HGRN2: slices above 64 tokens run the chunk kernels, slices <= 64 the recurrent ones.
    # Mamba2 (fla 0.6) takes one prefill and then single tokens only (see the refusal test).
    prefill = ((0, 150),) if name.startswith("mamba2") else CHUNKED_PREFILL
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    assert torch.isfinite(full).all()
    logits, _ = prefill_then_decode(model, ids, prefill)
    torch.testing.assert_close(logits, full, rtol=1e-8, atol=1e-8)


def test_mamba2_model_refuses_a_multi_token_step_with_a_cache_as_fla():
    model = MODELS["mamba2"]().double().eval()
    ids = torch.randint(0, VOCAB, (1, 40))
    cache = Cache()
    with torch.no_grad():
        model(ids[:, :20], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="single new token"):
            model(ids[:, 20:], past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("mode", ["parallel", "fused_chunk", "fused_recurrent"])
def test_retnet_modes_give_the_chunk_mode_forward(mode):
    model = MODELS["retnet"]().double().eval()
    ids = torch.randint(0, VOCAB, (2, 100))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        for layer in model.model.layers:
            layer.attn.mode = mode
        torch.testing.assert_close(model(ids, use_cache=False).logits, expected, rtol=1e-9, atol=1e-9)


def test_hgrn2_fused_chunk_mode_is_fla_s_deprecation_error():
    model = tiny_model("hgrn2", attn_mode="fused_chunk").eval()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="deprecated"):
        model(torch.randint(0, VOCAB, (1, 80)), use_cache=False)


@pytest.mark.parametrize("name", ["retnet", "hgrn2", "mamba2"])
def test_left_padded_batch_matches_unpadded_sequences(name):
    # RetNet / HGRN2 pack the sequences (cu_seqlens; RetNet's rotary per packed sequence), Mamba2 masks them
    model = MODELS[name]().double().eval()
    seqs = [torch.randint(1, VOCAB, (n,)) for n in (90, 30)]
    T = 90
    ids = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s) :] = s
        mask[i, T - len(s) :] = 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, use_cache=False).logits
        for i, s in enumerate(seqs):
            alone = model(s[None], use_cache=False).logits[0]
            torch.testing.assert_close(batched[i, T - len(s) :], alone, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["retnet", "hgrn2", "mamba2"])
def test_bfloat16_model_tracks_float32(name):
    model = MODELS[name]().eval()
    ids = torch.randint(0, VOCAB, (1, 120))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        model.bfloat16()
        cache = Cache()
        low = [model(ids[:, :100], past_key_values=cache, use_cache=True).logits]
        low += [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(100, 120)]
        low = torch.cat(low, 1)
    assert low.dtype == torch.bfloat16
    assert cache[0]["recurrent_state"].dtype == torch.float32  # states are accumulated in fp32
    err = (low.float() - reference).norm() / reference.norm()
    assert err < 2e-2, f"bf16 logits deviate from fp32 by {err:.3e} (relative)"


def test_mamba2_on_cuda_takes_the_torch_forward_only_where_fla_lacks_mamba_ssm(monkeypatch):
    from fla.layers import mamba2

    from ccq_eval.model.fla_cpu import backend

    layer = mamba2_layer()
    taken = []
    monkeypatch.setattr(type(layer).__bases__[0], "forward", lambda self, *a, **k: taken.append("fla"))
    served = backend._device_dispatching(type(layer).__bases__[0].forward, lambda self, *a, **k: taken.append("torch"),
                                         "hidden_states", mamba2_cuda_fallback := backend._device_forwards()[
                                             mamba2.Mamba2][2])
    cuda_like = torch.zeros(1)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    for has_kernels, expected in ((True, "fla"), (False, "torch")):
        monkeypatch.setattr(mamba2, "is_fast_path_available", has_kernels)
        assert mamba2_cuda_fallback() is not has_kernels
        served(layer, cuda_like)
        assert taken[-1] == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mamba2_on_cuda_without_mamba_ssm_matches_fla_torch_path():
    layer = mamba2_layer(D_has_hdim=True, norm_before_gate=True).cuda()
    x = torch.randn(2, 300, 32, device="cuda")
    with torch.no_grad():
        out, _, _ = layer(x)
        expected, _, _ = type(layer).__bases__[0].torch_forward(layer, x)
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)  # fla's product and our chunks: tf32 matmuls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mamba2_training_on_cuda_without_mamba_ssm_follows_fla_torch_path():
    """The backward through fla's chunk_simple_gla kernels (the Hopper-safe one where fla #640 applies), under
    the bf16 autocast training uses, is as close to fla's torch path in fp32 as fla's torch path is under the
    same autocast: per parameter, at most twice its error, or 1% of the gradient's largest entry (parameters
    with near-zero gradients, such as dt_bias, differ by bf16 rounding alone)."""
    layer = mamba2_layer(D_has_hdim=True, norm_before_gate=True).cuda()
    x = torch.randn(2, 300, 32, device="cuda")

    def fla_torch(h):
        return type(layer).__bases__[0].torch_forward(layer, h)

    grads = []
    for forward, dtype in ((layer, torch.bfloat16), (fla_torch, torch.bfloat16), (fla_torch, None)):
        layer.zero_grad()
        with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = forward(x)[0]
        out.float().square().mean().backward()
        grads.append({name: param.grad.clone() for name, param in layer.named_parameters()})
    ours, fla_bf16, fla_fp32 = grads
    for name, expected in fla_fp32.items():
        fla_error = (fla_bf16[name] - expected).abs().max()
        bound = torch.maximum(2 * fla_error, 1e-2 * expected.abs().max())
        assert (ours[name] - expected).abs().max() <= bound, (name, fla_error)
