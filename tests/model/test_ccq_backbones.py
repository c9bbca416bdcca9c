"""CCQ on the backbones beyond GLA and Gated DeltaNet (DeltaNet, KDA, RetNet, Mamba2, Preconditioned Gated
DeltaNet): lambda = 0 gives the backbone's own logits bit for bit, the read each layer makes equals a naive
per-token recurrence of the definition (docs/operator.md) in fp64 for every form, chunked prefill then decoding
equals one forward, a checkpoint round-trips through save and load, and a plain checkpoint takes CCQ
training-free."""

from __future__ import annotations

import json
import math

import pytest
import torch
from adapter_support import one_torch_thread  # noqa: F401
from cache_support import prefill_then_decode
from family_support import COMMON, SHAPES, byte_level_tokenizer, tiny_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from ccq_eval.model.backbones.seam import CCQReadMixin
from ccq_eval.model.families import ccq_family_for, family_of
from ccq_eval.model.loading import ModelLoadError, ccq_attach_config, load_model
from ccq_eval.model.modeling_ccq import CCQ_CLASSES, prepare_runtime

prepare_runtime()

BACKBONES = ["delta_net", "kda", "retnet", "mamba2", "precond_gated_deltanet"]
ONE_TOKEN_CACHE = {"mamba2"}  # fla's Mamba2 cache takes one token per call once it holds a state
FORMS = [("series", {"ccq_order": 1}), ("series", {"ccq_order": 2}), ("resolvent", {})]


def _tokens(n, seed=1):
    return torch.randint(3, 259, (1, n), generator=torch.Generator().manual_seed(seed))


def _ccq_model(model_type, seed=0, dtype=torch.float64, **ccq):
    """A random-init CCQ model of `model_type` with a trained-looking query gate (a_h != 0)."""
    config_cls, model_cls = CCQ_CLASSES[model_type]
    config = config_cls(**COMMON, **SHAPES[model_type], fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False,
                        **ccq)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("ccq_gate_weight"):
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed + 7))
    return model


def _ccq_layers(model):
    layers = [module for module in model.modules() if isinstance(module, CCQReadMixin)]
    assert len(layers) == COMMON["num_hidden_layers"]
    return layers


@pytest.mark.parametrize("model_type", BACKBONES)
def test_every_backbone_has_a_ccq_type_and_attaches_to_plain_checkpoints(model_type):
    ccq_type = f"ccq_{model_type}"
    assert family_of(ccq_type).has_ccq and family_of(ccq_type).model_class is CCQ_CLASSES[model_type][1]
    assert not family_of(model_type).has_ccq  # a plain checkpoint loads as fla's own model
    assert ccq_family_for(model_type) is family_of(ccq_type)


@pytest.mark.parametrize("model_type", BACKBONES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_lambda_zero_gives_the_backbones_logits_bit_for_bit(tmp_path, model_type, dtype):
    folder = tiny_checkpoint(model_type, tmp_path / model_type)
    plain, _ = load_model(str(folder), dtype=dtype)
    assert not isinstance(plain, CCQ_CLASSES[model_type][1])
    attached, _ = load_model(str(folder), dtype=dtype, ccq_lambda=0.0)
    acting, _ = load_model(str(folder), dtype=dtype, ccq_lambda=2.0)
    assert isinstance(attached, CCQ_CLASSES[model_type][1]) and attached.config.ccq
    for length in (150, 40):  # > 64 tokens: the chunk kernels; <= 64: the recurrent ones
        x = _tokens(length)
        with torch.no_grad():
            expected = plain(x, use_cache=False).logits
            assert torch.equal(attached(x, use_cache=False).logits, expected)
            assert not torch.equal(acting(x, use_cache=False).logits, expected)  # the attachment acts


def _capture_reads(model):
    """Wrap each CCQ layer's ccq_query (as ccq_eval.inspection does) to keep what it was given and returned."""
    captured = []
    for layer in _ccq_layers(model):
        def ccq_query(r, k, log_decay, ccq_state, keys_unit=False, layer=layer, method=layer.ccq_query):
            q, state = method(r, k, log_decay, ccq_state, keys_unit=keys_unit)
            captured.append({"layer": layer, "r": r, "keys": k, "log_decay": log_decay, "q": q,
                             "lam": layer.ccq_read_gate().values(r)})
            return q, state
        layer.ccq_query = ccq_query
    return captured


def _naive_read(r, keys, log_decay, lam, form, order):
    """q~ token by token from the definition: P, m, n by their recurrences, Sigma_t as a K x K matrix, then the
    series of order `order` or the exact resolvent (torch.linalg.solve). fp64 throughout."""
    r, keys, log_decay, lam = (t.double() for t in (r, keys, log_decay, lam))
    B, T, H, K = r.shape
    kappa = keys / keys.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    P, m, n = r.new_zeros(B, H, K, K), r.new_zeros(B, H, K), r.new_zeros(B, H)
    eye = torch.eye(K, dtype=r.dtype)
    out = []
    for t in range(T):
        gamma = log_decay[:, t].exp()
        P = gamma[..., None, None] * P + kappa[:, t, :, :, None] * kappa[:, t, :, None, :]
        m = gamma[..., None] * m + kappa[:, t]
        n = gamma * n + 1
        mu = m / n[..., None]
        sigma = P / n[..., None, None] - mu[..., :, None] * mu[..., None, :]
        A = lam[:, t, :, None, None] * sigma
        rt = r[:, t, :, :, None]
        if form == "resolvent":
            q = torch.linalg.solve(eye + A, rt)
        else:
            q, term = rt, rt
            for _ in range(order):
                term = -(A @ term)
                q = q + term
        out.append(q.squeeze(-1))
    return torch.stack(out, 1)


def _expected_log_decay(model_type, layer, call_r, log_decay):
    """gamma as each backbone defines it, recomputed from the layer's own parameters where it is fixed."""
    B, T, H, _ = call_r.shape
    if model_type == "delta_net":
        return torch.zeros(B, T, H, dtype=torch.float64)
    if model_type == "retnet":
        return torch.tensor([math.log(1 - 2.0 ** (-5 - h)) for h in range(H)], dtype=torch.float64).expand(B, T, H)
    return None  # KDA, Mamba2, Preconditioned Gated DeltaNet: input-dependent; checked by their own tests below


@pytest.mark.parametrize("model_type", BACKBONES)
@pytest.mark.parametrize(("form", "fields"), FORMS)
def test_the_chunked_read_equals_a_naive_recurrence_of_the_definition(model_type, form, fields):
    extra = {"ccq_solve_steps": 64} if form == "resolvent" else {}  # CG to convergence: compared to the exact solve
    model = _ccq_model(model_type, ccq_form=form, **fields, **extra)
    captured = _capture_reads(model)
    with torch.no_grad():
        model(_tokens(150), use_cache=False)
    assert len(captured) == COMMON["num_hidden_layers"]
    for read in captured:
        assert read["r"].dtype == torch.float64 and read["r"].shape[1] == 150
        assert bool((read["lam"] > 0).all()) and bool((read["log_decay"] <= 0).all())
        expected_decay = _expected_log_decay(model_type, read["layer"], read["r"], read["log_decay"])
        if expected_decay is not None:
            torch.testing.assert_close(read["log_decay"].double(), expected_decay, rtol=0, atol=1e-15)
        naive = _naive_read(read["r"], read["keys"], read["log_decay"], read["lam"], form, fields.get("ccq_order", 1))
        torch.testing.assert_close(read["q"], naive, rtol=1e-9, atol=1e-10)
        assert not torch.allclose(read["q"], read["r"], atol=1e-6)  # the read moves the query


def test_mamba2_reads_with_c_as_query_b_as_key_and_its_own_decay():
    model = _ccq_model("mamba2", ccq_form="series")
    layer = _ccq_layers(model)[0]
    captured = _capture_reads(model)
    x = _tokens(80)
    seen = {}
    def keep_input(module, args, kwargs):
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]

    handle = layer.register_forward_pre_hook(keep_input, with_kwargs=True)
    with torch.no_grad():
        model(x, use_cache=False)
    handle.remove()
    read = captured[0]
    H, N = layer.num_heads, layer.ssm_state_size
    projected = layer.in_proj(seen["hidden"])
    d_mlp = (projected.shape[-1] - 2 * layer.intermediate_size - 2 * layer.n_groups * N - H) // 2
    _, _, _, xBC, dt = projected.split([d_mlp, d_mlp, layer.intermediate_size, layer.conv_dim, H], dim=-1)
    conv = torch.nn.functional.conv1d(xBC.transpose(1, 2), layer.conv1d.weight, layer.conv1d.bias,
                                      padding=layer.conv1d.weight.shape[-1] - 1, groups=layer.conv_dim)
    xBC = layer.act(conv[..., : x.shape[1]].transpose(1, 2))
    _, B, C = xBC.split([layer.intermediate_size, layer.n_groups * N, layer.n_groups * N], dim=-1)
    per_head = H // layer.n_groups
    B, C = (t.reshape(*t.shape[:2], layer.n_groups, N).repeat_interleave(per_head, 2) for t in (B, C))
    dt = torch.nn.functional.softplus(dt + layer.dt_bias).clamp(*layer.dt_limit)
    torch.testing.assert_close(read["r"], C, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(read["keys"], B, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(read["log_decay"], -layer.A_log.exp() * dt, rtol=1e-12, atol=1e-12)


def _naive_written_keys(k, g_atk, beta_atk, log_atk_scale, x, eps):
    """The keys a Preconditioned Gated DeltaNet writes its state along, token by token as fla's naive reference
    (fla.ops.precond_gated_delta_rule.naive) forms them: A_t = exp(g_atk_t) A_{t-1} + beta_atk_t k_t^2, then
    w_t = k_t * exp(-log(x) s_t), s_t = u / (1 + |u|), u = log(A_t + eps) - log_atk_scale. fp64."""
    A = k.new_zeros(k.shape[0], k.shape[2], k.shape[3])
    written = []
    for t in range(k.shape[1]):
        A = A * g_atk[:, t, :, None].exp() + beta_atk[:, t, :, None] * k[:, t] ** 2
        u = torch.log(A + eps) - log_atk_scale[:, None]
        written.append(k[:, t] * torch.exp(-math.log(x) * u / (1 + u.abs())))
    return torch.stack(written, 1)


def test_precond_gated_deltanet_reads_with_the_unit_query_the_written_keys_and_the_main_decay():
    model = _ccq_model("precond_gated_deltanet", ccq_form="series")
    layer = _ccq_layers(model)[0]
    captured = _capture_reads(model)
    seen = {}
    def keep_input(module, args, kwargs):
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]

    def keep_output(name):
        def hook(module, args, out):
            seen[name] = out[0]  # ShortConvolution returns (output, cache)
        return hook

    hooks = [layer.register_forward_pre_hook(keep_input, with_kwargs=True),
             layer.q_conv1d.register_forward_hook(keep_output("q")),
             layer.k_conv1d.register_forward_hook(keep_output("k"))]
    with torch.no_grad():
        model(_tokens(100), use_cache=False)  # > 64 tokens: the chunk kernel
    for hook in hooks:
        hook.remove()
    read, hidden = captured[0], seen["hidden"]
    # fla's l2norm (the kernel's): x / sqrt(sum(x^2) + 1e-6)
    q, k = (x * (x.square().sum(-1, keepdim=True) + 1e-6).rsqrt()
            for x in (seen[name].unflatten(-1, (-1, layer.head_k_dim)) for name in ("q", "k")))
    softplus = torch.nn.functional.softplus
    # the two decays as fla's layer forms them (its .float() rounds A_log and the projection to fp32)
    g = -layer.A_log.float().exp() * softplus(layer.a_proj(hidden).float() + layer.dt_bias)
    g_atk = -layer.A_log_atk.float().exp() * softplus(layer.a_atk_proj(hidden).float() + layer.dt_bias_atk)
    written = _naive_written_keys(k, g_atk, layer.b_atk_proj(hidden).sigmoid(), layer.log_atk_scale, layer.squash_x,
                                  layer.squash_eps)
    torch.testing.assert_close(read["r"], q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(read["keys"], written, rtol=1e-12, atol=1e-12)  # chunked statistic vs per token
    torch.testing.assert_close(read["log_decay"], g, rtol=1e-12, atol=1e-12)  # the state's decay, not g_atk
    assert not torch.allclose(read["keys"] / read["keys"].norm(dim=-1, keepdim=True), k, atol=1e-3)  # not k


def test_precond_gated_deltanet_naive_mode_is_refused_by_ccq_layers():
    model = _ccq_model("precond_gated_deltanet", attn_mode="naive")
    with pytest.raises(ValueError, match="CCQ layers cannot read with naive_recurrent_precond_gated_delta_rule"), \
            torch.no_grad():
        model(_tokens(90), use_cache=False)
    # fla's naive reference computes in fp32 whatever the model's dtype
    baseline = _ccq_model("precond_gated_deltanet", attn_mode="naive", ccq=False, dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(baseline(_tokens(90), use_cache=False).logits).all()


@pytest.mark.parametrize("model_type", BACKBONES)
@pytest.mark.parametrize("ccq", [True, False])
def test_prefill_then_decode_equals_one_forward(model_type, ccq):
    model = _ccq_model(model_type, ccq=ccq, ccq_order=2)
    x = _tokens(160)
    prefill = ((0, 150),) if model_type in ONE_TOKEN_CACHE else ((0, 70), (70, 100), (100, 150))
    with torch.no_grad():
        full = model(x, use_cache=False).logits
    pieces, cache = prefill_then_decode(model, x, prefill)
    # fp64: slices of other lengths sum in another order inside the backbones' chunk kernels (about 1e-10 on the
    # logits without CCQ); a query gate up to lambda = 4 with the series of order 2 scales q~, and that rounding,
    # by up to 1 + 4 + 16
    torch.testing.assert_close(pieces, full, rtol=1e-8, atol=1e-8)
    if ccq:  # each layer's cached state is (S, P, m, n) for the delta rules, (S, P, m, n) under Mamba2's too
        state = cache[0]["recurrent_state"]
        if model_type == "precond_gated_deltanet":  # the ATK statistic stays beside it, where fla keeps it
            state, atk_statistic = state
            assert atk_statistic.shape == (1, model.config.num_heads, model.config.head_dim)
        assert isinstance(state, tuple) and len(state) == 4 and state[1].shape[-1] == state[1].shape[-2]


@pytest.mark.parametrize("model_type", BACKBONES)
def test_save_and_load_round_trip(tmp_path, model_type):
    model = _ccq_model(model_type, ccq_order=3, ccq_centered=False, ccq_decay="none", ccq_lambda_max=1.5,
                       ccq_gate_bias_init=-1.0)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    byte_level_tokenizer(model_type).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == f"ccq_{model_type}"
    loaded, _ = load_model(str(folder), dtype="float64")
    for field in ("ccq", "ccq_order", "ccq_centered", "ccq_decay", "ccq_gate", "ccq_lambda_max", "ccq_gate_bias_init"):
        assert getattr(loaded.config, field) == getattr(model.config, field)
    x = _tokens(90)
    with torch.no_grad():
        assert torch.equal(loaded(x, use_cache=False).logits, model(x, use_cache=False).logits)
    assert isinstance(AutoConfig.from_pretrained(folder), CCQ_CLASSES[model_type][0])
    assert isinstance(AutoModelForCausalLM.from_pretrained(folder), CCQ_CLASSES[model_type][1])


@pytest.mark.parametrize("model_type", BACKBONES)
def test_a_plain_checkpoint_loads_into_the_ccq_class_with_the_initial_gate(tmp_path, model_type):
    folder = tiny_checkpoint(model_type, tmp_path / model_type)
    config_cls, model_cls = CCQ_CLASSES[model_type]
    through_loader, _ = load_model(str(folder), ccq=True)
    through_class = model_cls.from_pretrained(folder, config=config_cls.from_pretrained(folder))
    for model in (through_loader, through_class):
        assert model.config.ccq and isinstance(model, model_cls)
        gates = {name: param for name, param in model.named_parameters() if "ccq_gate" in name}
        assert len(gates) == 2 * COMMON["num_hidden_layers"]
        for param in gates.values():
            assert torch.equal(param, torch.zeros_like(param))  # a_h = 0 and b_h = ccq_gate_bias_init = 0


@pytest.mark.parametrize("model_type", ["hgrn2", "rwkv7", "llama"])
def test_attaching_to_a_family_without_a_ccq_read_stops_in_one_line(tmp_path, model_type):
    folder = tiny_checkpoint(model_type, tmp_path / model_type)
    with pytest.raises(ModelLoadError) as error:
        ccq_attach_config(folder, 1.0)
    message = str(error.value)
    assert "\n" not in message
    assert message == (f"cannot attach CCQ to {model_type}: a {model_type} model has no CCQ in ccq-eval (it attaches "
                       "to gla, gated_deltanet, delta_net, kda, retnet, mamba2, precond_gated_deltanet); attach it "
                       "to a plain checkpoint of one of those families")


def test_retnet_parallel_form_is_refused_by_ccq_layers():
    model = _ccq_model("retnet", attn_mode="parallel")
    with pytest.raises(ValueError, match="CCQ layers cannot read with parallel_retention"), torch.no_grad():
        model(_tokens(90), use_cache=False)
    baseline = _ccq_model("retnet", attn_mode="parallel", ccq=False)
    with torch.no_grad():
        assert torch.isfinite(baseline(_tokens(90), use_cache=False).logits).all()


# ---- GPU: the backbone's CUDA kernels with q~ (not run on CPU machines) ------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's triton kernels")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model_type", BACKBONES)
def test_gpu_lambda_zero_matches_the_backbone_and_ccq_matches_the_cpu_path(tmp_path, model_type):
    """float32 where the backbone's CUDA kernel takes it; bfloat16 (looser bounds) where it refuses float32
    (DeltaNet's chunk_delta_rule)."""
    folder = tiny_checkpoint(model_type, tmp_path / model_type)
    x = _tokens(300)
    half_only = family_of(model_type).cuda_float32_blocker is not None
    dtype, same_kernels_bound, cpu_bound = (torch.bfloat16, 1e-2, 3e-2) if half_only else (torch.float32, 1e-3, 2e-3)
    plain, _ = load_model(str(folder), device="cuda", dtype=dtype)
    attached, _ = load_model(str(folder), device="cuda", dtype=dtype, ccq_lambda=0.0)
    with torch.no_grad():
        expected = plain(x.cuda(), use_cache=False).logits.float()
        got = attached(x.cuda(), use_cache=False).logits.float()
    relative = ((got - expected).norm() / expected.norm()).item()
    assert relative < same_kernels_bound, f"{model_type}: lambda = 0 on CUDA vs fla's model, relative L2 {relative:.2e}"
    model = _ccq_model(model_type, dtype=torch.float32)
    with torch.no_grad():
        cpu_logits = model(x, use_cache=False).logits
        gpu_logits = model.to("cuda", dtype)(x.cuda(), use_cache=False).logits.float().cpu()
    relative = ((gpu_logits - cpu_logits).norm() / cpu_logits.norm()).item()
    assert relative < cpu_bound, f"{model_type}: CCQ on CUDA vs the CPU path, relative L2 {relative:.2e}"
