"""CCQ-GLA / CCQ-Gated-DeltaNet: identity with fla at lambda = 0, state carrying, generation, loading."""

import json

import pytest
import torch
from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, GLAConfig, GLAForCausalLM
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, ByT5Tokenizer

from ccq_eval.model import fla_cpu
from ccq_eval.model.loading import ModelLoadError, load_model
from ccq_eval.model.modeling_ccq import (
    CCQGatedDeltaNetConfig,
    CCQGatedDeltaNetForCausalLM,
    CCQGLAConfig,
    CCQGLAForCausalLM,
    prepare_runtime,
)

prepare_runtime()  # the CCQ model types

TINY = {
    "gla": dict(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=384, use_short_conv=True),
    "gated_deltanet": dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, vocab_size=384),
}
FLA = {"gla": (GLAConfig, GLAForCausalLM), "gated_deltanet": (GatedDeltaNetConfig, GatedDeltaNetForCausalLM)}
CCQ = {"gla": (CCQGLAConfig, CCQGLAForCausalLM),
       "gated_deltanet": (CCQGatedDeltaNetConfig, CCQGatedDeltaNetForCausalLM)}
KINDS = ["gla", "gated_deltanet"]


def _fla_model(kind, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    config_cls, model_cls = FLA[kind]
    return fla_cpu.use_torch_backend(model_cls(config_cls(**TINY[kind]))).to(dtype).eval()


def _ccq_model(kind, seed=0, dtype=torch.float64, **ccq):
    torch.manual_seed(seed)
    config_cls, model_cls = CCQ[kind]
    model = model_cls(config_cls(**TINY[kind], **ccq)).to(dtype).eval()
    # A trained-looking gate: non-zero a_h so lambda depends on the query.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("ccq_gate_weight"):
                param.normal_(0, 0.5)
    return model


def _save(model, folder, tokenizer=True):
    model.save_pretrained(folder)
    if tokenizer:
        ByT5Tokenizer().save_pretrained(folder)
    return folder


def _tokens(n, seed=1, vocab=384):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_lambda_zero_reproduces_fla_logits(kind, tmp_path):
    fla_model = _fla_model(kind)
    folder = _save(fla_model, tmp_path / kind)
    ccq_model, _ = load_model(str(folder), ccq=True, dtype="float64")
    assert ccq_model.config.ccq
    for name, param in ccq_model.named_parameters():  # CCQ parameters start at their initial values
        if name.endswith("ccq_gate_weight"):
            assert torch.equal(param, torch.zeros_like(param))
        if name.endswith("ccq_gate_bias"):
            assert torch.equal(param, torch.zeros_like(param))
    x = _tokens(150)  # > 64: the chunk kernels
    with torch.no_grad():
        expected = fla_model(x).logits
        assert not torch.allclose(ccq_model(x).logits, expected, atol=1e-6)  # CCQ at lambda_max / 2 acts
        for name, param in ccq_model.named_parameters():
            if name.endswith("ccq_gate_bias"):
                param.fill_(float("-inf"))  # lambda = lambda_max * sigmoid(-inf) = 0
        got = ccq_model(x).logits
    # The same ops on q~ = r exactly (Gated DeltaNet's q, k normalised outside the kernel for CCQ, on
    # the same strided views as fla's in-kernel normalisation: kernels/l2norm_pair.py).
    assert torch.equal(got, expected)
    # ccq=False runs fla's own forward: bit for bit.
    baseline, _ = load_model(str(folder), dtype="float64")
    assert not baseline.config.ccq
    with torch.no_grad():
        assert torch.equal(baseline(x).logits, expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ccq", [True, False])
def test_chunked_prefill_then_decode_equals_full_forward(kind, ccq):
    model = _ccq_model(kind, ccq=ccq, ccq_order=2)
    x = _tokens(203)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        out = model(x[:, :130], use_cache=True)
        pieces = [out.logits]
        cache = out.past_key_values
        out = model(x[:, 130:197], past_key_values=cache, use_cache=True)  # a second chunk (> 64 tokens)
        pieces.append(out.logits)
        for t in range(197, 203):  # one-token decode steps
            out = model(x[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ccq", [True, False])
def test_greedy_generate_equals_full_recompute(kind, ccq):
    model = _ccq_model(kind, seed=3, dtype=torch.float32, ccq=ccq)
    prompt = _tokens(90, seed=4)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True,
                                   pad_token_id=0, eos_token_id=None)
        sequence = prompt
        for _ in range(12):  # greedy by recomputing the whole sequence every step
            next_token = model(sequence, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], 1)
    assert generated.tolist() == sequence.tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_training_step_reaches_ccq_parameters(kind):
    model = _ccq_model(kind, dtype=torch.float32).train()
    x = _tokens(100)
    loss = model(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters() if "ccq_gate" in n}
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_round_trip(kind, tmp_path):
    model = _ccq_model(kind, ccq_order=3, ccq_centered=False, ccq_decay="none", ccq_gate="constant",
                       ccq_lambda_max=1.5, ccq_gate_bias_init=-1.0)
    folder = _save(model, tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == f"ccq_{kind}"
    assert (folder / "model.safetensors").exists()
    loaded, tokenizer = load_model(str(folder), dtype="float64")
    for field in ("ccq", "ccq_order", "ccq_centered", "ccq_decay", "ccq_gate", "ccq_lambda_max"):
        assert getattr(loaded.config, field) == getattr(model.config, field)
    x = _tokens(80)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    # The Auto classes know the type too.
    assert isinstance(AutoConfig.from_pretrained(folder), CCQ[kind][0])
    assert isinstance(AutoModelForCausalLM.from_pretrained(folder), CCQ[kind][1])
    assert tokenizer("abc").input_ids[:3] == ByT5Tokenizer()("abc").input_ids[:3]


def test_old_fused_chunk_config_loads_as_chunk(tmp_path):
    folder = _save(_fla_model("gla"), tmp_path / "old")
    config = json.loads((folder / "config.json").read_text())
    config["attn_mode"] = "fused_chunk"
    (folder / "config.json").write_text(json.dumps(config))
    model, _ = load_model(str(folder))
    assert model.config.attn_mode == "chunk"
    assert all(block.attn.mode == "chunk" for block in model.model.layers)


@pytest.mark.parametrize("field,value,message", [
    ("ccq_order", 0, "ccq_order"),
    ("ccq_lambda_max", 0.0, "ccq_lambda_max"),
    ("ccq_lambda_max", -1.0, "ccq_lambda_max"),
    ("ccq_decay", "exponential", "ccq_decay"),
    ("ccq_gate", "key", "ccq_gate"),
    ("ccq_form", "neumann", r"ccq_form must be one of \('series', 'resolvent'\), got 'neumann'"),
    ("ccq_form", None, "ccq_form must be one of"),
    ("ccq_solve_steps", 0, "ccq_solve_steps must be an integer >= 1, got 0"),
    ("ccq_solve_steps", 2.5, "ccq_solve_steps must be an integer >= 1, got 2.5"),
    ("ccq_solve_steps", True, "ccq_solve_steps must be an integer >= 1, got True"),
])
def test_invalid_ccq_fields_are_rejected(tmp_path, field, value, message):
    folder = _save(_ccq_model("gla"), tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(str(folder))
    assert "config.json" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message) as info:
        CCQGLAConfig(**{field: value})
    assert "\n" not in str(info.value)


def test_bad_checkpoints_give_clear_errors(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(str(empty))

    folder = _save(_fla_model("gla"), tmp_path / "unknown")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "not_a_family"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"unknown model_type 'not_a_family'.*ccq-eval models --families"):
        load_model(str(folder))

    # A pickle-only checkpoint: refused without the opt-in, before anything is unpickled.
    pickled = _save(_fla_model("gla"), tmp_path / "pickled")
    state = {k: v for k, v in _fla_model("gla").state_dict().items()}
    (pickled / "model.safetensors").unlink()
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"pickle.*allow_pickle"):
        load_model(str(pickled))
    model, _ = load_model(str(pickled), allow_pickle=True, dtype="float64")
    with torch.no_grad():
        x = _tokens(20)
        torch.testing.assert_close(model(x).logits, _fla_model("gla")(x).logits)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="hub is offline"):
        load_model("fla-hub/gla-340M-15B")
    with pytest.raises(ModelLoadError, match="unknown model"):
        load_model("no-such-model")


def test_safetensors_written_by_hand_loads(tmp_path):
    """A folder made without save_pretrained (config.json + a bare safetensors file) loads too."""
    model = _fla_model("gated_deltanet", dtype=torch.float32)
    folder = tmp_path / "manual"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**model.config.to_dict(), "model_type": "gated_deltanet"}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
               or not model.config.tie_word_embeddings}, folder / "model.safetensors")
    ByT5Tokenizer().save_pretrained(folder)
    loaded, _ = load_model(str(folder))
    x = _tokens(70)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lambda_max", [2.0, 4.0])
def test_outputs_finite_at_20k_tokens(kind, lambda_max):
    model = _ccq_model(kind, dtype=torch.float32, ccq_lambda_max=lambda_max)
    with torch.no_grad():
        logits = model(_tokens(20480), use_cache=False, logits_to_keep=1024).logits
    assert torch.isfinite(logits).all()


# ---- GPU: fla's kernels vs the CPU path on the same weights ---------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's triton kernels")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 5e-2)])
def test_gpu_kernels_match_cpu_path(kind, dtype, tol):
    config_cls, model_cls = CCQ[kind]
    torch.manual_seed(0)
    shape = dict(hidden_size=256, num_hidden_layers=2, num_heads=4, vocab_size=384)
    if kind == "gated_deltanet":
        shape["head_dim"] = 64
    model = model_cls(config_cls(**shape)).eval()
    x = _tokens(4096)
    with torch.no_grad():
        cpu_logits = model(x, use_cache=False).logits.float()
        gpu_model = model.to("cuda", dtype)
        gpu_logits = gpu_model(x.cuda(), use_cache=False).logits.float().cpu()
    relative = (gpu_logits - cpu_logits).norm() / cpu_logits.norm()
    print(f"{kind} {dtype}: relative L2 error GPU vs CPU = {relative:.2e} (tolerance {tol})")
    assert relative < tol


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_training_gradients_match_cpu_path(kind):
    """Loss and gradients of a CCQ model on fla's kernels (fp32) vs the CPU backend, same weights."""
    config_cls, model_cls = CCQ[kind]
    torch.manual_seed(0)
    shape = dict(hidden_size=128, num_hidden_layers=2, num_heads=2, vocab_size=384)
    if kind == "gated_deltanet":
        shape["head_dim"] = 64
    model = model_cls(config_cls(**shape, fuse_cross_entropy=False)).train()
    x = _tokens(300)

    def loss_and_grads(device):
        model.to(device).zero_grad()
        loss = model(x.to(device), labels=x.to(device), use_cache=False).loss
        loss.backward()
        return loss.item(), {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}

    cpu_loss, cpu_grads = loss_and_grads("cpu")
    gpu_loss, gpu_grads = loss_and_grads("cuda")
    assert gpu_loss == pytest.approx(cpu_loss, rel=2e-3)
    worst = max(((gpu_grads[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in cpu_grads.items())
    print(f"{kind}: loss CPU {cpu_loss:.5f} GPU {gpu_loss:.5f}; worst relative gradient error {worst:.2e}")
    assert worst < 2e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_20k_forward_runs(kind):
    config_cls, model_cls = CCQ[kind]
    model = model_cls(config_cls(hidden_size=512, num_hidden_layers=4, num_heads=4, vocab_size=384))
    model = model.to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        logits = model(_tokens(20480).cuda(), use_cache=False).logits
    assert logits.shape[1] == 20480 and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("kind", KINDS)
def test_all_ones_attention_mask_is_accepted_and_padding_is_refused(kind):
    """lm-eval's HFLM always passes an all-ones mask; real padding is refused with a clear error."""
    model = _ccq_model(kind)
    x = _tokens(90)
    with torch.no_grad():
        expected = model(x).logits
        torch.testing.assert_close(model(x, attention_mask=torch.ones_like(x)).logits, expected, rtol=0, atol=0)
        padded = torch.ones(2, 90, dtype=torch.long)
        padded[1, :10] = 0
        with pytest.raises(ValueError, match="padded batches"):
            model(x.repeat(2, 1), attention_mask=padded)
