#!/usr/bin/env python
"""Train the embedded demonstration checkpoints: tiny-gla, tiny-gla-ccq, tiny-gdn, tiny-gdn-ccq, the
softmax-attention reference tiny-transformer, and the linear-attention baselines tiny-deltanet,
tiny-kda, tiny-mamba2 and tiny-precond-gdn (fla's own classes, no CCQ twin).

Within a family (GLA, Gated DeltaNet) the two models share everything but the CCQ flag: shape,
initial backbone weights (same seed; CCQ's gate parameters consume no random numbers), data
stream, token budget, context length and optimiser; the other models get the same data, seed, steps
and optimiser. Data: scripts/tiny_data.py (embedded corpora, train split only, and synthetic
in-context recall documents in our own wording, with several questions each and a distance
curriculum).

GPU (fla's triton kernels, bf16 autocast; the defaults are stage 1 of the shipped models, whose
stage 2 continues with --init-from: scripts/README.md), one model per process, all five sharing
one GPU (scripts/gpu_session.sh does this):
    python scripts/train_tiny.py --models tiny-gla-ccq --device cuda --data-workers 2 --out models
CPU smoke run (tiny shape, a few steps on repeated data, writes to a temporary folder):
    python scripts/train_tiny.py --smoke
Rewrite models/registry.json entries and model cards for folders already trained:
    python scripts/train_tiny.py --register-only --out models

Each model is written to <out>/<name>/ (config.json, model.safetensors in bf16, tokenizer files,
README.md model card, train_log.json) through a temporary folder renamed into place, so a killed
run leaves no half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

# Deterministic cuBLAS needs this before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCRIPTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCRIPTS_DIR.parent
for _path in (str(SCRIPTS_DIR), str(REPO_ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import tiny_data  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from model_card import config_summary, describe, git_commit, hardware, model_card, software_versions  # noqa: E402
from train_settings import (  # noqa: E402
    FLA_OWN_FAMILIES,
    MODEL_SPECS,
    ModelSpec,
    TrainSettings,
    parse_args,
    parse_models,
    settings_from_args,
)

from ccq_eval.model.modeling_ccq import (  # noqa: E402
    CCQGatedDeltaNetConfig,
    CCQGatedDeltaNetForCausalLM,
    CCQGLAConfig,
    CCQGLAForCausalLM,
)

MAX_CHECKPOINT_BYTES = 8 * 1000 * 1000  # at most 8 MB of safetensors per checkpoint (the tracked tree's budget)
VOCAB_SIZE = 384  # ByT5: 3 specials + 256 bytes + 125 extra ids

# Family shapes: fla's defaults for everything not listed (GLA: expand_k 0.5, expand_v 1; Gated
# DeltaNet: expand_v 2; both: short convolution of width 4, MLP ratio 4, untied embeddings). GLA's
# short convolution (off by fla's default) lets a layer see the bytes just before a value, which
# in-context recall needs. The Transformer is the softmax-attention reference: transformers' Llama
# with the same width, depth and MLP, 4 heads of 64. The other baselines keep fla's defaults but for width,
# depth and heads (short convolutions on, as fla's defaults have them); Mamba2 blocks have no MLP, so it
# gets twice the layers for about the same size. All sized for the 8 MB limit in bf16 (3.3M-3.7M parameters).
SHAPES = {
    "gla": {"hidden_size": 256, "num_hidden_layers": 4, "num_heads": 2, "use_short_conv": True},
    "gdn": {"hidden_size": 256, "num_hidden_layers": 4, "num_heads": 2, "head_dim": 64},
    "llama": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
              "intermediate_size": 768},
    "delta_net": {"hidden_size": 256, "num_hidden_layers": 4, "num_heads": 2},
    "kda": {"hidden_size": 256, "num_hidden_layers": 4, "num_heads": 2, "head_dim": 64},
    "mamba2": {"hidden_size": 256, "num_hidden_layers": 8, "num_heads": 8, "head_dim": 64, "expand": 2,
               "state_size": 64, "n_groups": 1},
    "precond_gdn": {"hidden_size": 256, "num_hidden_layers": 4, "num_heads": 2, "head_dim": 64},
}
SMOKE_SHAPES = {
    "gla": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "use_short_conv": True},
    "gdn": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 16},
    "llama": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
              "intermediate_size": 96},
    "delta_net": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2},
    "kda": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 16},
    "mamba2": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 16, "expand": 2,
               "state_size": 16, "n_groups": 1},
    "precond_gdn": {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 16},
}


# ---------------------------------------------------------------------------------------- models
def model_config(spec: ModelSpec, context: int, smoke: bool):
    """The config of a model: the CCQ class for GLA and Gated DeltaNet (baselines: ccq=False, i.e. exactly
    fla's model), fla's own config for the other linear baselines, transformers' LlamaConfig for the
    Transformer."""
    shape = (SMOKE_SHAPES if smoke else SHAPES)[spec.family]
    common = {
        "vocab_size": VOCAB_SIZE, "pad_token_id": tiny_data.PAD_ID, "eos_token_id": tiny_data.EOS_ID,
        "bos_token_id": None,
        # Records the training context (linear attention has no positional limit; RoPE has no hard one).
        "max_position_embeddings": context,
    }
    if spec.family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**shape, **common, tie_word_embeddings=False, rope_theta=10000.0)
    if spec.family in FLA_OWN_FAMILIES:
        import fla  # noqa: F401  (registers its model types with the Auto classes)
        from transformers import AutoConfig

        return AutoConfig.for_model(FLA_OWN_FAMILIES[spec.family], **shape, **common)
    config_cls = CCQGLAConfig if spec.family == "gla" else CCQGatedDeltaNetConfig
    return config_cls(**shape, **common, ccq=spec.ccq)


def build_model(spec: ModelSpec, context: int, smoke: bool, seed: int):
    """Fresh model in fp32; the backbone's initial weights depend only on the seed and the shape."""
    config = model_config(spec, context, smoke)
    torch.manual_seed(seed)
    if spec.family == "llama":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(config)
    if spec.family in FLA_OWN_FAMILIES:
        from transformers import AutoModelForCausalLM

        from ccq_eval.model import fla_cpu

        return fla_cpu.use_torch_backend(AutoModelForCausalLM.from_config(config))  # the CPU runs it too
    model_cls = CCQGLAForCausalLM if spec.family == "gla" else CCQGatedDeltaNetForCausalLM
    return model_cls(config)


def count_parameters(model, ccq: bool) -> int:
    # A baseline is saved without the (unused) CCQ gate parameters, so they are not counted.
    return sum(p.numel() for n, p in model.named_parameters() if ccq or "ccq_" not in n)


def trainable_groups(model, ccq: bool, weight_decay: float, train_parts: str = "all", freeze: str | None = None):
    """AdamW groups: decay on the matrices of linear layers only (not embeddings, norms, biases,
    gates' small vectors or CCQ's gate). Left out (and frozen): the baseline's unused CCQ parameters,
    whatever `train_parts` excludes and the parameters whose names the `freeze` pattern matches."""
    frozen_by_pattern = [name for name, _ in model.named_parameters() if freeze and re.search(freeze, name)]
    if freeze and not frozen_by_pattern:
        raise SystemExit(f"--freeze {freeze!r} matches no parameter of the model; its parameter names look like "
                         f"{next(name for name, _ in model.named_parameters())!r}")
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        is_gate = "ccq_" in name
        if ((is_gate and (not ccq or train_parts == "backbone")) or (not is_gate and train_parts == "ccq-gate")
                or name in frozen_by_pattern):
            param.requires_grad_(False)
            continue
        if param.ndim == 2 and "embed" not in name and "ccq_" not in name:
            decay.append(param)
        else:
            no_decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def learning_rate(step: int, settings: TrainSettings) -> float:
    """Linear warmup to lr, then cosine to lr * min_lr_ratio at the last step."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    span = max(1, settings.steps - settings.warmup_steps - 1)
    progress = min(1.0, (step - settings.warmup_steps) / span)
    floor = settings.lr * settings.min_lr_ratio
    return floor + 0.5 * (settings.lr - floor) * (1.0 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------------ data
class BatchDataset(torch.utils.data.Dataset):
    """Item s = the batch of step s (a pure function of seed and s), for prefetching workers."""

    def __init__(self, stream: tiny_data.TrainStream, steps: int, batch_size: int):
        self.stream, self.steps, self.batch_size = stream, steps, batch_size

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int):
        """(tokens, answer mask: True at the bytes of recall answers' values, synthetic token count)."""
        rows, synthetic = [], 0
        answers = torch.zeros(self.batch_size, self.stream.ctx + 1, dtype=torch.bool)
        for i in range(self.batch_size):
            ids, segments = self.stream.sequence(step * self.batch_size + i)
            rows.append(ids)
            synthetic += sum(s.end - s.start for s in segments if s.kind == "synthetic")
            for segment in segments:
                for begin, end in segment.answers:
                    answers[i, begin:end] = True
        return torch.tensor(rows, dtype=torch.long), answers, synthetic


def batch_loader(settings: TrainSettings):
    ramp = int(settings.curriculum_share * settings.steps * settings.batch_size)
    stream = tiny_data.TrainStream(settings.seed, settings.context, settings.synthetic_fraction, settings.repeat,
                                   ramp=ramp, max_questions=settings.max_questions)
    dataset = BatchDataset(stream, settings.steps, settings.batch_size)
    return torch.utils.data.DataLoader(
        dataset, batch_size=None, shuffle=False, num_workers=settings.data_workers,
        pin_memory=settings.device.startswith("cuda"), prefetch_factor=4 if settings.data_workers else None,
        persistent_workers=False,
    )


# ------------------------------------------------------------------------------------- training
def autocast_context(device: str):
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()  # CPU: fp32


def lm_loss(model, tokens: torch.Tensor, answers: torch.Tensor | None = None, answer_weight: float = 1.0):
    """Next-byte NLL (nats) of tokens[:, 1:] given tokens[:, :-1], computed in fp32: the mean, or with
    `answers` (a mask over tokens) the weighted mean in which answer bytes count `answer_weight` times."""
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    nll = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    if answers is None or answer_weight == 1.0:
        return nll.mean()
    weights = 1.0 + (answer_weight - 1.0) * answers[:, 1:].flatten().float()
    return (nll * weights).sum() / weights.sum()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def init_folder(spec: ModelSpec, settings: TrainSettings) -> Path:
    """The checkpoint a continued run starts from: the family's baseline for both twins (so they start
    from identical backbone weights), the Transformer's own for the Transformer."""
    name = spec.twin if spec.ccq else spec.name
    folder = Path(settings.init_from) / name
    if not (folder / "config.json").is_file():
        raise SystemExit(f"--init-from {settings.init_from}: no checkpoint {folder} (config.json) to continue "
                         f"{spec.name} from; train it first or point --init-from at a folder holding {name}/")
    return folder


def ccq_gate_fields(settings: TrainSettings) -> dict:
    """CCQ config fields of a continued CCQ twin: with --ccq-init-lambda L the gate starts at exactly L
    (gate weights 0, bias 0, so sigmoid = 1/2, and ccq_lambda_max = 2 L): a query gate may then move
    within [0, 2 L]; without it the config's defaults."""
    fields = {"ccq": True, "ccq_gate": settings.ccq_gate}
    if settings.ccq_init_lambda is not None:
        fields |= {"ccq_lambda_max": 2.0 * settings.ccq_init_lambda, "ccq_gate_bias_init": 0.0}
    return fields


def initial_model(spec: ModelSpec, settings: TrainSettings):
    """A fresh model (seeded), or with --init-from the trained baseline's weights in fp32; the CCQ twin
    gets CCQ attached with its gate at its initial values (ccq_gate_fields; no random numbers drawn)."""
    torch.manual_seed(settings.seed)
    if not settings.init_from:
        return build_model(spec, settings.context, settings.smoke, settings.seed)
    from ccq_eval.model.loading import checkpoint_family, read_config
    from ccq_eval.model.modeling_ccq import prepare_runtime

    prepare_runtime()
    folder = init_folder(spec, settings)
    config = read_config(folder, **ccq_gate_fields(settings)) if spec.ccq else read_config(folder)
    model_cls = checkpoint_family(folder).model_class
    model, info = model_cls.from_pretrained(folder, config=config, dtype=torch.float32, use_safetensors=True,
                                            local_files_only=True, output_loading_info=True)
    if spec.family in FLA_OWN_FAMILIES:  # fla's classes get ccq-eval's op dispatch, as build_model gives them
        from ccq_eval.model import fla_cpu

        model = fla_cpu.use_torch_backend(model)
    # Only CCQ's gate may be absent (a baseline's checkpoint has none); it starts at its initial values.
    missing = [key for key in info.get("missing_keys") or [] if ".ccq_gate_" not in key]
    if missing or info.get("unexpected_keys"):
        raise SystemExit(f"--init-from {folder}: the weights do not match the model (missing {missing}, unexpected "
                         f"{info.get('unexpected_keys')})")
    return model


def train(spec: ModelSpec, settings: TrainSettings) -> tuple[torch.nn.Module, dict]:
    device = settings.device
    model = initial_model(spec, settings).to(device)
    model.train()
    optimizer = torch.optim.AdamW(
        trainable_groups(model, spec.ccq, settings.weight_decay, settings.train_parts, settings.freeze),
        lr=settings.lr,
        betas=(settings.beta1, settings.beta2), eps=1e-8,
    )
    tokens_per_step = settings.batch_size * settings.context
    step_losses: list[torch.Tensor] = []  # kept on the device: no host sync except when logging
    losses: list[float] = []
    log: list[dict] = []
    synthetic_tokens = total_tokens = 0
    print(f"[{spec.name}] {count_parameters(model, spec.ccq):,} parameters, {settings.steps} steps x "
          f"{settings.batch_size} x {settings.context} tokens on {device}", flush=True)
    synchronize(device)
    start = interval_start = time.perf_counter()
    first_interval_end = None
    for step, (batch, answers, synthetic) in enumerate(batch_loader(settings)):
        lr = learning_rate(step, settings)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = batch.to(device, non_blocking=True)
        answers = answers.to(device, non_blocking=True)
        with autocast_context(device):
            loss = lm_loss(model, batch, answers, settings.answer_weight)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_losses.append(loss.detach())
        synthetic_tokens += synthetic
        total_tokens += batch.numel()
        done = step + 1
        if done % settings.log_every == 0 or done == settings.steps:
            synchronize(device)
            now = time.perf_counter()
            new = torch.stack(step_losses).float().cpu().tolist()
            step_losses.clear()
            if not all(math.isfinite(x) for x in new):
                raise FloatingPointError(f"[{spec.name}] non-finite training loss by step {done}: {new}")
            steps_in_interval = len(new)
            losses.extend(new)
            throughput = steps_in_interval * tokens_per_step / (now - interval_start)
            record = {
                "step": done, "loss": sum(new) / len(new), "lr": lr, "grad_norm": float(grad_norm),
                "tokens_seen": done * tokens_per_step, "elapsed_s": now - start, "tokens_per_s": throughput,
            }
            log.append(record)
            print(f"[{spec.name}] step {done}/{settings.steps} loss {record['loss']:.4f} lr {lr:.2e} "
                  f"grad_norm {record['grad_norm']:.3f} {throughput:,.0f} tok/s "
                  f"elapsed {record['elapsed_s']:.1f}s", flush=True)
            if first_interval_end is None:
                first_interval_end = (done, now)
            interval_start = now
    synchronize(device)
    train_seconds = time.perf_counter() - start
    # Throughput after the first logging interval (it includes triton's kernel compilation).
    steady = None
    if first_interval_end is not None and first_interval_end[0] < settings.steps:
        steady = (settings.steps - first_interval_end[0]) * tokens_per_step / (start + train_seconds
                                                                                - first_interval_end[1])
    tail = max(1, settings.steps // 20)
    summary = {
        "step_losses": losses,
        "log": log,
        "final_train_loss": sum(losses[-tail:]) / len(losses[-tail:]),
        "final_train_loss_steps": tail,
        "first_train_loss": losses[0],
        "train_seconds": train_seconds,
        "tokens_seen": settings.steps * tokens_per_step,
        "tokens_per_s_overall": settings.steps * tokens_per_step / train_seconds,
        "tokens_per_s_steady": steady,
        "synthetic_token_fraction": synthetic_tokens / max(1, total_tokens),
    }
    print(f"[{spec.name}] trained in {train_seconds:.1f}s: {summary['tokens_per_s_overall']:,.0f} tok/s overall"
          + (f", {steady:,.0f} tok/s after the first {settings.log_every} steps" if steady else "")
          + f"; final train loss {summary['final_train_loss']:.4f} (mean of last {tail} steps); "
          f"synthetic token fraction {summary['synthetic_token_fraction']:.3f}", flush=True)
    return model, summary


# ------------------------------------------------------------------------------------ evaluation
def heldout_precision(model, device: str):
    """fp32 (no autocast), except on CUDA for a family whose fla kernel refuses fp32 (DeltaNet's
    chunk_delta_rule): there bf16 autocast, as in training."""
    from ccq_eval.model.families import family_of

    family = family_of(getattr(model.config, "model_type", None))
    if device.startswith("cuda") and family is not None and family.cuda_float32_blocker:
        return autocast_context(device)
    return contextlib.nullcontext()


@torch.no_grad()
def heldout_metrics(model, settings: TrainSettings) -> dict:
    """Held-out NLL per byte (nats) on fixed eval-split windows and teacher-forced recall on fixed
    held-out recall documents. Run on the weights as saved, in fp32 where the family's kernels take it
    (heldout_precision)."""
    with heldout_precision(model, settings.device):
        return _heldout_metrics(model, settings)


def _heldout_metrics(model, settings: TrainSettings) -> dict:
    device = settings.device
    model.eval()
    windows, where = tiny_data.heldout_windows(settings.context, settings.eval_windows)
    nll_sum, count = 0.0, 0
    for chunk in windows.split(8):
        chunk = chunk.to(device)
        logits = model(input_ids=chunk[:, :-1], use_cache=False).logits.float()
        nll = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        nll_sum += float(nll)
        count += chunk[:, 1:].numel()
    nll_per_byte = nll_sum / count

    docs = tiny_data.heldout_recall_docs(settings.context, settings.recall_docs)
    exact, answers, value_nll, value_bytes = 0, 0, 0.0, 0
    for first in range(0, len(docs), 8):
        group = docs[first : first + 8]
        rows = [tiny_data.encode_bytes(d.text) for d in group]
        width = max(len(r) for r in rows)
        # Right padding cannot change causal predictions at earlier positions.
        batch = torch.tensor([r + [tiny_data.PAD_ID] * (width - len(r)) for r in rows], device=device)
        logits = model(input_ids=batch, use_cache=False).logits.float()
        for i, doc in enumerate(group):
            for begin, value in doc.answers:  # byte offset of the value = its token position (no BOS)
                end = begin + len(value.encode())
                targets = batch[i, begin:end]
                predicted = logits[i, begin - 1 : end - 1]
                exact += bool((predicted.argmax(-1) == targets).all())
                answers += 1
                value_nll += float(F.cross_entropy(predicted, targets, reduction="sum"))
                value_bytes += end - begin
    return {
        "heldout_nll_per_byte": nll_per_byte,
        "heldout_bits_per_byte": nll_per_byte / math.log(2),
        "heldout_perplexity": math.exp(nll_per_byte),
        "heldout_windows": where,
        "heldout_scored_bytes": count,
        "recall_exact_match": exact / answers,
        "recall_value_nll_per_byte": value_nll / value_bytes,
        "recall_docs": len(docs),
        "recall_answers": answers,
    }


# ---------------------------------------------------------------------------------------- saving


def save_weights(model, spec: ModelSpec, folder: Path, save_dtype: str) -> None:
    """config.json + model.safetensors. Baselines are saved as plain fla models (model_type gla /
    gated_deltanet, no CCQ parameters): fla alone loads them, and ccq_eval loads them with ccq off.
    The Transformer and the other baselines are plain transformers / fla checkpoints as they are."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[save_dtype]
    model = copy.deepcopy(model).to("cpu", dtype)
    if spec.ccq or spec.twin is None:
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(folder)  # transformers 5 writes safetensors only
        return
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, GLAConfig, GLAForCausalLM

    config_cls, model_cls = ((GLAConfig, GLAForCausalLM) if spec.family == "gla"
                             else (GatedDeltaNetConfig, GatedDeltaNetForCausalLM))
    fields = {k: v for k, v in model.config.to_dict().items()
              if not k.startswith("ccq") and k not in ("model_type", "architectures", "transformers_version")}
    plain = model_cls(config_cls(**fields)).to(dtype)
    state = {k: v for k, v in model.state_dict().items() if "ccq_" not in k}
    plain.load_state_dict(state, strict=True)
    plain.config.architectures = [model_cls.__name__]
    plain.save_pretrained(folder)  # transformers 5 writes safetensors only


def init_record(spec: ModelSpec, settings: TrainSettings) -> dict | None:
    """What a continued run started from: the checkpoint's name and its own training record (settings,
    summary without the loss curve, held-out numbers, command, commit), kept for the model card."""
    if not settings.init_from:
        return None
    folder = init_folder(spec, settings)
    log = json.loads((folder / "train_log.json").read_text(encoding="utf-8"))
    train = {k: v for k, v in log["train"].items() if k not in ("step_losses", "log")}
    return {"checkpoint": folder.name, "settings": log["settings"], "train": train, "heldout": log["heldout"],
            "command": log["command"], "git_commit": log["git_commit"], "init": log.get("init")}


def replace_folder(tmp: Path, final: Path) -> None:
    """Move a finished temporary folder into place: an old folder is renamed aside first and deleted last."""
    old = final.with_name(f".old-{final.name}.{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def remove_leftovers(out: Path, name: str) -> None:
    """Temporary folders of this model left by a killed run (never the finished <out>/<name>)."""
    if out.is_dir():
        for path in out.glob(f".tmp-{name}.*"):
            shutil.rmtree(path, ignore_errors=True)
        for path in out.glob(f".old-{name}.*"):
            shutil.rmtree(path, ignore_errors=True)


def write_model(spec: ModelSpec, model, settings: TrainSettings, summary: dict, out: Path, command: str,
                started: float) -> dict:
    from transformers import ByT5Tokenizer

    from ccq_eval.model.loading import load_model

    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}.", dir=out))
    try:
        save_weights(model, spec, tmp, settings.save_dtype)
        ByT5Tokenizer().save_pretrained(tmp)
        weights_bytes = (tmp / "model.safetensors").stat().st_size
        if weights_bytes > MAX_CHECKPOINT_BYTES:
            raise ValueError(f"{spec.name}: model.safetensors is {weights_bytes / 1e6:.2f} MB, over the 10 MB limit; "
                             "use --save-dtype bf16 or a smaller shape")
        # Evaluate exactly what is shipped: reload the folder as users will.
        saved, _ = load_model(str(tmp), device=settings.device)
        metrics = heldout_metrics(saved, settings)
        del saved
        config = json.loads((tmp / "config.json").read_text())
        info = {
            "name": spec.name, "family": spec.family, "ccq": spec.ccq, "model_type": config["model_type"],
            "parameters": count_parameters(model, spec.ccq), "weights_bytes": weights_bytes,
            "config_summary": config_summary(model), "settings": asdict(settings), "train": summary,
            "heldout": metrics, "hardware": hardware(settings.device), "software": software_versions(),
            "git_commit": settings.code_commit or git_commit(), "command": command,
            "total_seconds": time.perf_counter() - started,
            "ccq_settings": ", ".join(f"{k} {v}" for k, v in config.items() if k.startswith("ccq_")),
            "init": init_record(spec, settings),
        }
        (tmp / "README.md").write_text(model_card(spec, settings, info), encoding="utf-8")
        (tmp / "train_log.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is meant to be shared
        for file in tmp.iterdir():
            file.chmod(0o644)
        replace_folder(tmp, out / spec.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"[{spec.name}] wrote {out / spec.name}: held-out {metrics['heldout_nll_per_byte']:.4f} nats/byte, "
          f"perplexity {metrics['heldout_perplexity']:.2f} (uniform: 256), recall exact match "
          f"{metrics['recall_exact_match']:.1%}, weights {weights_bytes / 1e6:.2f} MB", flush=True)
    return info


# -------------------------------------------------------------------------------------- registry
def register_models(out: Path, names: list[str], default: bool = True) -> Path:
    """(Re)write the entries of `names` in <out>/registry.json (models/registry.json's format:
    {name: {"path", "description", "default"}}), keeping other entries. Locked, then atomic rename,
    so parallel training processes cannot lose each other's entries."""
    import fcntl
    import hashlib

    registry = out / "registry.json"
    out.mkdir(parents=True, exist_ok=True)
    # The lock lives outside <out> so that committing models/ cannot pick it up.
    lock_name = "ccq-tiny-registry-" + hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16] + ".lock"
    with open(Path(tempfile.gettempdir()) / lock_name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = json.loads(registry.read_text(encoding="utf-8")) if registry.exists() else {}
        for name in names:
            folder = out / name
            log_file = folder / "train_log.json"
            if not (folder / "config.json").exists() or not log_file.exists():
                raise FileNotFoundError(f"cannot register {name}: {folder} has no trained checkpoint "
                                        "(config.json and train_log.json); train it first")
            info = json.loads(log_file.read_text(encoding="utf-8"))
            spec = MODEL_SPECS[name]
            settings = TrainSettings(**info["settings"])
            entries[name] = {
                "path": name,
                "description": describe(spec, info["parameters"], settings, info["heldout"]),
                "default": default and spec.in_default_run,
            }
            # The card is rendered from the log, so a corrected template reaches shipped models too.
            (folder / "README.md").write_text(model_card(spec, settings, info), encoding="utf-8")
        tmp = registry.with_name(f".registry.json.{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, registry)
    return registry


# ------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> dict[str, dict]:
    args = parse_args(argv)
    specs = parse_models(args.models)
    out = args.out
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="ccq-tiny-smoke-")) if args.smoke else REPO_ROOT / "models"
    if args.register_only:
        registry = register_models(out, [s.name for s in specs])
        print(f"registered {', '.join(s.name for s in specs)} in {registry}")
        return {}
    settings = settings_from_args(args)
    gateless = [spec.name for spec in specs if settings.train_parts == "ccq-gate" and not spec.ccq]
    if gateless:
        raise SystemExit(f"--train ccq-gate trains CCQ's gate alone, and {', '.join(gateless)} has none: train the CCQ "
                         "twins only (their baselines stay as they are, which is their fair twin)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if settings.device.startswith("cuda"):
        # Deterministic where torch offers it; fla's triton kernels are outside this switch.
        torch.use_deterministic_algorithms(True, warn_only=True)
        # That switch would also NaN-fill every torch.empty (fla allocates its outputs so): not needed.
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.backends.cuda.matmul.allow_tf32 = False
    command = "python " + shlex.join(["scripts/train_tiny.py", *(sys.argv[1:] if argv is None else argv)])
    results = {}
    for spec in specs:
        started = time.perf_counter()
        remove_leftovers(out, spec.name)
        model, summary = train(spec, settings)
        results[spec.name] = write_model(spec, model, settings, summary, out, command, started)
        del model
        if settings.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.register if args.register is not None else not settings.smoke:
        registry = register_models(out, [s.name for s in specs])
        print(f"registered {', '.join(results)} in {registry}")
    print("summary: " + json.dumps({name: {
        "heldout_nll_per_byte": round(info["heldout"]["heldout_nll_per_byte"], 5),
        "heldout_perplexity": round(info["heldout"]["heldout_perplexity"], 3),
        "recall_exact_match": info["heldout"]["recall_exact_match"],
        "final_train_loss": round(info["train"]["final_train_loss"], 5),
        "train_seconds": round(info["train"]["train_seconds"], 1),
        "tokens_per_s_steady": info["train"]["tokens_per_s_steady"],
        "weights_mb": round(info["weights_bytes"] / 1e6, 3),
    } for name, info in results.items()}), flush=True)
    print(f"output: {out}")
    return results


if __name__ == "__main__":
    main()
