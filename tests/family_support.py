"""Tiny random-init checkpoints of every model family the CPU tests cover (tests/model/test_families.py,
tests/cli/test_cli_families.py): fla's families through their own configs, transformers' Llama, Qwen2 and
Mistral, each saved as a checkpoint folder with a byte-level tokenizer, as a user's checkpoint would be."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, ByT5Tokenizer

VOCAB = 384  # the byte tokenizer's 259 ids, padded as the embedded models' tables are
COMMON = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": VOCAB, "pad_token_id": 0, "eos_token_id": 1,
          "bos_token_id": None}
SOFTMAX = {"intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
           "max_position_embeddings": 4096}
# model_type -> the fields that make a small model of it (the rest are the family's defaults)
SHAPES: dict[str, dict] = {
    "gla": {"num_heads": 2},
    "gated_deltanet": {"num_heads": 2, "head_dim": 32},
    "delta_net": {"num_heads": 2},
    "kda": {"num_heads": 2, "head_dim": 32},
    "precond_gated_deltanet": {"num_heads": 2, "head_dim": 32},
    "precond_kda": {"num_heads": 2, "head_dim": 32},
    "mamba": {"state_size": 8},
    # residual_in_fp32 (Mamba2's default) would round a float64 model's residual stream to float32
    "mamba2": {"num_heads": 4, "head_dim": 32, "expand": 2, "state_size": 16, "n_groups": 1,
               "residual_in_fp32": False},
    "retnet": {"num_heads": 2},
    "hgrn2": {"num_heads": 2, "expand_ratio": 32},
    "rwkv7": {"head_dim": 32},
    "llama": SOFTMAX,
    "qwen2": SOFTMAX,
    "mistral": {**SOFTMAX, "sliding_window": None},
}
# The families the backbone work promises on the CPU (fla's with a torch path, and transformers' three).
CPU_FAMILIES = ("delta_net", "gated_deltanet", "kda", "mamba2", "retnet", "hgrn2", "rwkv7", "precond_gated_deltanet",
                "precond_kda", "llama", "qwen2", "mistral")


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A random-init causal LM of `model_type` in its own classes (fla's or transformers'), float32."""
    import fla  # noqa: F401  (registers fla's families with the Auto classes)

    config = AutoConfig.for_model(model_type, **COMMON, **SHAPES[model_type])
    for flag in ("fuse_norm", "fuse_swiglu", "fuse_cross_entropy"):
        if hasattr(config, flag):  # the fused variants are the same model; these keep a CPU fallback honest
            setattr(config, flag, False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def byte_level_tokenizer(model_type: str):
    """A byte-level tokenizer a checkpoint of `model_type` keeps: ByT5's, or for Qwen2 and Mistral (whose
    tokenizer class transformers chooses itself) a byte-level BPE with no merges, one token per byte."""
    if model_type not in ("qwen2", "mistral"):
        return ByT5Tokenizer()
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({char: 3 + byte for byte, char in bytes_to_unicode().items()})
    return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", pad_token="<pad>", eos_token="</s>",
                          bos_token=None)


def tiny_checkpoint(model_type: str, folder: Path, seed: int = 0) -> Path:
    """A checkpoint folder (config.json, model.safetensors, tokenizer) of a tiny random `model_type` model."""
    tiny_model(model_type, seed).save_pretrained(folder)
    byte_level_tokenizer(model_type).save_pretrained(folder)
    return folder
