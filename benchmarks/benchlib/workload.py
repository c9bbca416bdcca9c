"""What the benchmark runs: model shapes, random-init CCQ models with CCQ switchable in place (so the
baseline and CCQ share every weight), random-init models of fla's own families (no CCQ) and CCQ attached
to their weights, a FLOP model for MFU, tokenizers, a long document, and S-NIAH prompts."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
MISTRAL_TOKENIZER = REPO / "tests" / "fixtures" / "tokenizers" / "mistral_v1"
ARCHS = ("gla", "gated_deltanet")
# fla families built in fla's own classes, as ccq-eval loads their checkpoints (issue 54): no CCQ layers, so
# they run once, CCQ off; the sniah section times them.
FLA_ARCHS = ("delta_net", "kda", "mamba2")
# The other backbones CCQ attaches to (ccq_eval.model.modeling_ccq.CCQ_CLASSES): the model section times
# fla's own model (build_fla_model) against a CCQ model holding the same weights (attach_ccq), as
# load_model(path, ccq_lambda=...) gives a plain checkpoint CCQ: the baseline is the model ccq-eval loads for
# the plain checkpoint, not a CCQ model switched off.
ATTACH_ARCHS = ("delta_net", "kda", "retnet", "mamba2", "precond_gated_deltanet")

# fla's 340M shapes, as flame's configs/gla_340M.json and configs/gated_deltanet_340M.json give
# them (hidden 1024; GLA 24 layers x 4 heads, expand_k 0.5; Gated DeltaNet 21 layers x 6 heads x 256,
# expand_v 2, short conv). Everything else stays at fla 0.6.0's config defaults (fused norm, swiglu
# and cross entropy on).
SHAPES_340M: dict[str, dict[str, Any]] = {
    "gla": {
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_heads": 4,
        "expand_k": 0.5,
        "expand_v": 1,
        "hidden_ratio": 4,
        "attn_mode": "chunk",
        "tie_word_embeddings": True,
        "initializer_range": 0.006,
        "norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "gated_deltanet": {
        "hidden_size": 1024,
        "num_hidden_layers": 21,
        "num_heads": 6,
        "head_dim": 256,
        "expand_v": 2,
        "hidden_ratio": 4,
        "use_short_conv": True,
        "conv_size": 4,
        "use_gate": True,
        "attn_mode": "chunk",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # flame's configs/delta_net_340M.json: 24 layers x 8 heads of 128, no output gate, short conv.
    "delta_net": {
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_heads": 8,
        "expand_k": 1,
        "expand_v": 1,
        "use_gate": False,
        "use_short_conv": True,
        "conv_size": 4,
        "hidden_ratio": 4,
        "attn_mode": "chunk",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # flame ships no KDA config: DeltaNet's 340M layout (24 layers, heads of 128 filling hidden 1024), as
    # fla's KDA defaults fill hidden 2048 with 16 heads of 128.
    "kda": {
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_heads": 8,
        "head_dim": 128,
        "expand_v": 1,
        "use_short_conv": True,
        "conv_size": 4,
        "hidden_ratio": 4,
        "attn_mode": "chunk",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # flame's configs/mamba2_340M.json in fla 0.6.0's names: 48 blocks (no MLP), 32 heads of 64, state 128.
    "mamba2": {
        "hidden_size": 1024,
        "num_hidden_layers": 48,
        "head_dim": 64,
        "state_size": 128,
        "expand": 2,
        "n_groups": 1,
        "conv_kernel": 4,
        "chunk_size": 256,
        "residual_in_fp32": True,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "norm_eps": 1e-5,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # flame ships no RetNet config: fla's RetNetConfig defaults (24 layers x 8 heads, expand_k 1, expand_v 2,
    # hidden_ratio 2, output gate) at hidden 1024: heads of 128 (keys) / 256 (values), 380.2M parameters.
    "retnet": {
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_heads": 8,
        "expand_k": 1,
        "expand_v": 2,
        "hidden_ratio": 2,
        "attn_mode": "chunk",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
# flame ships no Preconditioned Gated DeltaNet config: fla's PrecondGatedDeltaNetConfig defaults are
# GatedDeltaNetConfig's (21 layers x 6 heads x 256, expand_v 2, short conv, output gate), so Gated
# DeltaNet's 340M shape above (flame's configs/gated_deltanet_340M.json), with the preconditioner at
# fla's defaults (226 parameters more than Gated DeltaNet's 512.3M at the 32K vocabulary): its
# CCQ/baseline ratio reads against the gated_deltanet row's.
SHAPES_340M["precond_gated_deltanet"] = dict(SHAPES_340M["gated_deltanet"])
# CPU smoke shapes: the same model classes, a few seconds for everything.
SHAPES_SMOKE: dict[str, dict[str, Any]] = {
    "gla": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2},
    "gated_deltanet": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 32},
    "delta_net": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2},
    "kda": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 32},
    "mamba2": {"hidden_size": 64, "num_hidden_layers": 2, "head_dim": 16, "state_size": 16, "expand": 2,
               "n_groups": 1, "chunk_size": 32},
    "retnet": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2},
    "precond_gated_deltanet": {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 32},
}

# fla's chunked kernels work on blocks of this many tokens (BT = 64 in chunk_gla / chunk_simple_gla /
# chunk_gated_delta_rule); only the FLOP estimate uses it.
KERNEL_CHUNK = 64


def model_classes(arch: str):
    from ccq_eval.model.modeling_ccq import (
        CCQGatedDeltaNetConfig,
        CCQGatedDeltaNetForCausalLM,
        CCQGLAConfig,
        CCQGLAForCausalLM,
    )

    classes = {
        "gla": (CCQGLAConfig, CCQGLAForCausalLM),
        "gated_deltanet": (CCQGatedDeltaNetConfig, CCQGatedDeltaNetForCausalLM),
    }
    if arch not in classes:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    return classes[arch]


def build_model(
    arch: str, shape: dict[str, Any], vocab_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> torch.nn.Module:
    """A random-init CCQ model (CCQ layers attached, enabled), or for an arch of FLA_ARCHS / ATTACH_ARCHS
    fla's own model (build_fla_model). Built directly on `device`."""
    if arch in FLA_ARCHS or arch in ATTACH_ARCHS:
        return build_fla_model(arch, shape, vocab_size, device, dtype, seed)
    config_cls, model_cls = model_classes(arch)
    config = config_cls(vocab_size=vocab_size, ccq=True, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    _trained_looking_gate(model)
    return model.to(dtype).eval()


def _trained_looking_gate(model: torch.nn.Module) -> None:
    # A query-dependent gate, as after training (a = 0 would make lambda constant); costs the same.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("ccq_gate_weight"):
                param.normal_(0.0, 0.02)


def build_fla_model(
    arch: str, shape: dict[str, Any], vocab_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> torch.nn.Module:
    """A random-init model of fla's own class for `arch` (families.fla_families), prepared as ccq-eval's
    loader prepares an fla checkpoint (loading.load_model): fla_cpu's backend on its modules (fla's kernels
    on CUDA, Mamba2's layer without mamba_ssm: its SSD as fla's chunk_simple_gla; torch ops elsewhere),
    and generate()'s `cache` keyword read as fla's `past_key_values`, so that stock HFLM decodes from the
    carried state."""
    from ccq_eval.model import fla_cpu
    from ccq_eval.model.families import fla_families
    from ccq_eval.model.loading import read_generate_cache_keyword

    family = fla_families()[arch]
    config = family.config_class(vocab_size=vocab_size, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = family.model_class(config)
    fla_cpu.use_torch_backend(model)
    model.register_forward_pre_hook(read_generate_cache_keyword, with_kwargs=True)
    return model.to(dtype).eval()


def attach_ccq(
    baseline: torch.nn.Module, arch: str, shape: dict[str, Any], vocab_size: int, seed: int = 0, **ccq_fields: Any
) -> torch.nn.Module:
    """A CCQ model of backbone `arch` holding every weight of `baseline` (fla's own model, build_fla_model,
    built from the same `shape` and `vocab_size`), on its device and in its dtype, in eval mode. CCQ as
    build_model's GLA / Gated DeltaNet models have it: on, order 1, the query gate with b = 0 and a drawn
    small (lambda near 2, query-dependent), unless `ccq_fields` (CCQ config fields) say otherwise, e.g.
    ccq_eval.model.loading.constant_gate_fields(0.0): lambda = 0, which reads as the baseline does."""
    from ccq_eval.model.modeling_ccq import CCQ_CLASSES

    config_cls, model_cls = CCQ_CLASSES[arch]
    config = config_cls(vocab_size=vocab_size, **shape, **{"ccq": True, **ccq_fields})
    reference = next(baseline.parameters())
    torch.manual_seed(seed)
    with torch.device(reference.device):
        model = model_cls(config)
    # Only the CCQ gate is the twin's own (missing from the baseline's weights); any other difference is a
    # shape or naming mismatch, which would time a different model.
    missing, unexpected = model.load_state_dict(baseline.state_dict(), strict=False)
    stray = [key for key in missing if ".ccq_gate_" not in key] + list(unexpected)
    if stray or not missing:
        raise ValueError(f"{arch}: the CCQ model's weights do not match fla's model's ({sorted(stray)[:3]})")
    if config.ccq_gate == "query":
        _trained_looking_gate(model)
    return model.to(reference.dtype).eval()


def ccq_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from ccq_eval.model.modeling_ccq import CCQReadMixin

    return [m for m in model.modules() if isinstance(m, CCQReadMixin)]


def set_ccq(model: torch.nn.Module, enabled: bool) -> None:
    """Switch CCQ on or off in every layer. Off runs fla's own layer forward (the baseline)."""
    layers = ccq_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no CCQ layers to switch")
    for layer in layers:
        layer.ccq_enabled = enabled
    model.config.ccq = enabled


@contextmanager
def ccq_mode(model: torch.nn.Module, enabled: bool):
    """CCQ switched on or off in `model` for the block, then restored. A model without CCQ layers (fla's
    own, FLA_ARCHS) runs unchanged with CCQ off, and raises with it on."""
    if not ccq_layers(model):
        if enabled:
            raise ValueError(f"{type(model).__name__} has no CCQ layers to switch on")
        yield model
        return
    previous = [layer.ccq_enabled for layer in ccq_layers(model)]
    previous_config = model.config.ccq
    set_ccq(model, enabled)
    try:
        yield model
    finally:
        for layer, flag in zip(ccq_layers(model), previous, strict=True):
            layer.ccq_enabled = flag
        model.config.ccq = previous_config


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def forward_flops_per_token(model: torch.nn.Module, ccq_enabled: bool) -> dict[str, float]:
    """Estimated forward FLOPs per token (multiply-add = 2 FLOPs).

    - dense: every nn.Linear (the LM head included: logits for every position) and conv weights;
    - sequence mixing, per layer and head, for fla's chunked form with chunk C: intra-chunk
      scores and their product with values, 2C(d_k + d_v), plus the read and the write of the
      d_k x d_v state, 4 d_k d_v. Gated DeltaNet adds the WY/UT correction, about 2C(d_k + d_v) +
      2 d_k d_v more;
    - CCQ, per order (or resolvent solve step): one more such pass with v = k (2C * 2 d_k + 4 d_k^2).
    Training is counted as 3x forward (backward = 2x forward). Embedding lookups, norms, gates and
    the loss are not counted. An estimate for MFU, not an operation count of the kernels.
    """
    from ccq_eval.model.ccq import sigma_passes

    dense = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            dense += 2.0 * module.in_features * module.out_features
        elif isinstance(module, torch.nn.Conv1d):
            dense += 2.0 * module.weight.numel()
    mixing = 0.0
    ccq = 0.0
    C = KERNEL_CHUNK
    for module in model.modules():
        if not all(hasattr(module, name) for name in ("num_heads", "head_k_dim", "head_v_dim", "q_proj")):
            continue
        heads = getattr(module, "num_v_heads", None) or module.num_heads
        dk, dv = module.head_k_dim, module.head_v_dim
        per_head = 2 * C * (dk + dv) + 4 * dk * dv
        if hasattr(module, "b_proj"):  # Gated DeltaNet: the delta-rule correction
            per_head += 2 * C * (dk + dv) + 2 * dk * dv
        mixing += heads * per_head
        if ccq_enabled and getattr(module, "ccq_order", None):
            passes = sigma_passes(module.ccq_form, module.ccq_order, module.ccq_solve_steps)
            ccq += module.num_heads * passes * (2 * C * 2 * dk + 4 * dk * dk)
    return {"dense": dense, "mixing": mixing, "ccq": ccq, "total": dense + mixing + ccq}


# ------------------------------------------------------------------------------------------ tokens
def load_tokenizer(spec: str):
    """'mistral' (the 32K SentencePiece fixture in tests/fixtures), 'byt5', or a tokenizer folder."""
    s_niah = s_niah_utils()
    if spec == "mistral":
        spec = str(MISTRAL_TOKENIZER)
    return s_niah.load_tokenizer(spec), spec


def s_niah_utils():
    """tasks/s_niah/utils.py (lm-eval loads it by path; from the repository root it is a package module)."""
    return importlib.import_module("ccq_eval.tasks.s_niah.utils")


def prefix_ids(tokenizer) -> list[int]:
    """What the ccq adapter puts before every text: BOS when the tokenizer has one."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if bos is not None else []


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def long_document(tokenizer, n_tokens: int, corpus: str = "austen") -> str:
    """Natural text that the adapter feeds as about n_tokens tokens (its BOS included): the start of
    the embedded corpus' eval documents, cut at a token boundary."""
    from ccq_eval.data.corpora import load_corpus

    docs = load_corpus(corpus, split="eval")
    text = "\n\n".join(doc.text for doc in docs)
    want = n_tokens - len(prefix_ids(tokenizer))
    chars = 8 * want
    while True:
        ids = encode(tokenizer, text[:chars])
        if len(ids) > want or chars >= len(text):
            break
        chars *= 2
    if len(ids) < want:
        raise ValueError(f"corpus {corpus!r} has only {len(ids)} tokens of this tokenizer; {want} needed")
    return tokenizer.decode(ids[:want])


def sniah_docs(tokenizer_spec: str, lengths: list[int], depths: list[float], seed: int = 42) -> list[dict]:
    """S-NIAH-1 docs (RULER niah_single_1 construction, this project's port) sized in the
    tokenizer's tokens; a doc's nominal length includes the 128-token generation budget."""
    return s_niah_utils().generate_docs(
        "s_niah_1", lengths=lengths, depths=depths, samples_per_cell=1, seed=seed, tokenizer=tokenizer_spec
    )


def random_tokens(
    n_rows: int, n_tokens: int, vocab_size: int, device: torch.device, seed: int = 1
) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n_rows, n_tokens), generator=generator).to(device)
