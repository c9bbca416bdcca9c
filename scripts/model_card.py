"""Model cards of the embedded checkpoints trained by train_tiny.py: the README.md of each folder and the
one-line description in models/registry.json, from the run's settings, summary and held-out numbers."""

from __future__ import annotations

import contextlib
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import tiny_data
import torch

import ccq_eval

if TYPE_CHECKING:
    from train_settings import ModelSpec, TrainSettings

REPO_ROOT = Path(__file__).resolve().parent.parent

FAMILY_NAMES = {"gla": "GLA (gated linear attention)", "gdn": "Gated DeltaNet",
                "llama": "softmax-attention Transformer (Llama architecture)", "delta_net": "DeltaNet",
                "kda": "KDA (Kimi Delta Attention)", "mamba2": "Mamba2",
                "precond_gdn": "Preconditioned Gated DeltaNet"}


def software_versions() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("flash-linear-attention", "fla-core", "transformers", "triton", "safetensors"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    versions["ccq-eval"] = ccq_eval.__version__
    if torch.cuda.is_available():
        versions["cuda"] = torch.version.cuda
    return versions


def hardware(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} (CUDA {torch.version.cuda})"
    return f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "scripts", "ccq_eval"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        return head + (" (with uncommitted changes in scripts/ or ccq_eval/)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"


def describe(spec: ModelSpec, params: int, settings: TrainSettings, metrics: dict | None = None) -> str:
    """The registry's one-line description: what the model is, what its CCQ gate is, and what its last
    training stage froze (shared bit for bit with its twin)."""
    kind = ("with CCQ on the read" if spec.ccq else "baseline, no CCQ" if spec.twin
            else "the upper-bound reference for the linear models" if spec.family == "llama"
            else "a linear-attention baseline to compare CCQ with (fla's own model, no CCQ)")
    if spec.ccq and settings.ccq_gate == "constant":
        lam = f"lambda {settings.ccq_init_lambda:g}" if settings.ccq_init_lambda is not None else "its initial lambda"
        kind += f" through a constant gate ({lam}, not learned)"
    if settings.freeze and spec.twin:
        from train_settings import FREEZE_PRESETS

        frozen = {regex: name for name, regex in FREEZE_PRESETS.items()}.get(settings.freeze, settings.freeze)
        kind += (f"; fine-tuned from {spec.name.removesuffix('-ccq')}'s stage 2 like its twin {spec.twin}, with "
                 f"--freeze {frozen!r} (those weights bit-identical in the two)")
    text = (f"{FAMILY_NAMES[spec.family]}, {kind}; {params / 1e6:.1f}M parameters, byte-level, trained at "
            f"{settings.context} tokens on the embedded corpora + synthetic recall (demonstration model)")
    if metrics:
        text += f"; held-out perplexity {metrics['heldout_perplexity']:.2f} per byte"
    return text


def earlier_stages(record: dict | None) -> list[dict]:
    """The training runs a continued model went through before this one, the first first."""
    stages = []
    while record:
        stages.insert(0, record)
        record = record.get("init")
    return stages


def gate_words(settings: TrainSettings) -> str:
    """How a continued CCQ twin's gate starts and trains, for its model card."""
    start = (f"at lambda = {settings.ccq_init_lambda:g} (lambda_max {2 * settings.ccq_init_lambda:g})"
             if settings.ccq_init_lambda is not None else "at its initial values")
    how = {"all": "trained with the backbone", "backbone": "frozen (only the backbone trained)",
           "ccq-gate": "trained alone (the backbone frozen)"}[settings.train_parts]
    return f"its {settings.ccq_gate} gate {start}, {how}"


def stage_line(number: int, record: dict) -> str:
    """One model-card line on an earlier training stage of a continued model."""
    st, tr = record["settings"], record["train"]
    return (f"- Stage {number} (`{record['checkpoint']}`'s run): {st['steps']} steps x {st['batch_size']} x "
            f"{st['context']} tokens ({tr['tokens_seen']:,} tokens), synthetic fraction {st['synthetic_fraction']:g}, "
            f"curriculum over {st.get('curriculum_share', 0):.0%} of the steps, {st.get('max_questions', 4)} "
            f"questions at most per recall document, answer weight {st.get('answer_weight', 1.0):g}, lr {st['lr']:g}; "
            f"{tr['train_seconds']:.0f} s; held-out perplexity {record['heldout']['heldout_perplexity']:.2f}. "
            f"Command: `{record['command']}` (commit {record['git_commit']}).")


def card_head(spec: ModelSpec, settings: TrainSettings, info: dict) -> list[str]:
    """The model card's title, summary and Model section."""
    fmt = info["config_summary"]
    if spec.twin:
        what = ("with the Curvature-Conditioned Query (CCQ) on the state read" if spec.ccq
                else "without CCQ (baseline)")
        fairness = (f"Its twin `{spec.twin}` shares the shape, initial backbone weights, data, seed, token budget, "
                    "context and optimiser; only the CCQ flag differs.")
        if spec.ccq and settings.train_parts == "ccq-gate":
            fairness = (f"Its backbone is its twin `{spec.twin}`'s, unchanged: only CCQ's gate was trained, so the "
                        "two differ in the CCQ read alone.")
    else:
        what = ("(softmax attention with a KV cache), the upper-bound reference row" if spec.family == "llama"
                else "(fla's own model, no CCQ), a baseline of another linear-attention family to compare CCQ with")
        fairness = ("It is trained with the same data stream, seed, steps, batch, context and optimiser as the "
                    "other embedded models, at about the same size.")
    if spec.family == "llama":
        architecture = (f"- Architecture: `{info['model_type']}` ({fmt}); rotary positions; "
                        "plain transformers checkpoint")
    elif not spec.twin:
        architecture = (f"- Architecture: `{info['model_type']}` ({fmt}); plain fla checkpoint (loads with fla "
                        "alone; `ccq_eval` loads it in fla's classes, on the CPU through its torch backend)")
    else:
        architecture = (f"- Architecture: `{info['model_type']}` ({fmt}); CCQ: "
                        + (f"on ({info['ccq_settings']})" if spec.ccq
                           else "off; saved as a plain fla model (loads with fla alone; `ccq_eval` loads it with "
                                "ccq off)"))
    return [
        f"# {spec.name}",
        "",
        (f"A small {FAMILY_NAMES[spec.family]} language model {what}, trained by this project as an embedded "
         f"default for `ccq-eval`. {fairness}"),
        "",
        (f"**A demonstration model, not the paper's.** It has {info['parameters'] / 1e6:.1f}M parameters, reads "
         "bytes, and was trained for minutes on a few megabytes of public-domain English. Numbers from it show how "
         "the harness behaves and how CCQ compares with its baseline at this scale; they say nothing about 1.3B "
         "models.")
        + (" Smoke-test run: tiny shape, a few steps on repeated data; not a usable model." if settings.smoke
           else ""),
        "",
        "## Model",
        "",
        architecture,
        f"- Parameters: {info['parameters']:,}; weights stored in {settings.save_dtype} "
        f"(model.safetensors, {info['weights_bytes'] / 1e6:.2f} MB)"
        + ("; trained in fp32 master weights, rounded to bf16 on saving" if settings.save_dtype == "bf16" else ""),
        ("- Tokenizer: byte-level ByT5 (`transformers.ByT5Tokenizer`, vocab 384: pad 0, eos 1, unk 2, byte b -> "
         "b + 3); no BOS."),
        (f"- Training context: {settings.context} tokens (bytes); `max_position_embeddings` records it."),
        "",
    ]


def model_card(spec: ModelSpec, settings: TrainSettings, info: dict) -> str:
    """The README.md of a trained checkpoint: model, training (every stage), held-out numbers, commands."""
    tm, mm = info["train"], info["heldout"]
    stages = earlier_stages(info.get("init"))
    steady = tm["tokens_per_s_steady"]
    lines = [
        *card_head(spec, settings, info),
        "## Training",
        "",
        "- Data (scripts/tiny_data.py): a deterministic stream of sequences of "
        f"{settings.context} + 1 byte tokens, each packed from whole documents (EOS after each, the last one cut). "
        "Natural documents: spans of the train split of the embedded corpora sotu, kjv and austen. Synthetic "
        f"in-context recall documents (drawn with probability {settings.synthetic_fraction:g}): 1-8 key-value "
        "records hidden in train-split filler (or a repeated line of plain sentences), then up to "
        f"{settings.max_questions} questions about distinct records, each followed by its answer "
        "(e.g. `Record: the pass code for <key> equals <value>.` ... `What is the pass code for <key>? The pass "
        "code for <key> is <value>.`). Values are mostly 7-digit numbers, also other numbers, UUIDs and words; "
        "keys are word pairs from the train split. Distance curriculum: a synthetic document's size is "
        + (f"log-uniform up to a cap that grows from {tiny_data.CURRICULUM_START} bytes to the full context over "
           f"the first {settings.curriculum_share:.0%} of the steps." if settings.curriculum_share > 0 else
           "log-uniform up to the full context from the first step (no curriculum in this stage).")
        + " Held out: no RULER template, needle or "
        "answer-prefix wording, none of S-NIAH's key words (tasks/s_niah/key_words.txt) in any training key, and "
        "no eval-split text (S-NIAH's essay haystack) is ever trained on; tests check the stream for RULER's "
        f"phrases. Synthetic share of the training tokens: {tm['synthetic_token_fraction']:.1%}."
        + (f" Smoke run: the first {settings.repeat} sequence(s) repeated every step." if settings.repeat else ""),
        *([*(stage_line(i + 1, record) for i, record in enumerate(stages)),
           f"- Stage {len(stages) + 1} (this run) continues from `{info['init']['checkpoint']}`"
           + ((f" with CCQ attached ({gate_words(settings)})" + (
               f"; its twin `{spec.twin}` is that baseline, unchanged" if settings.train_parts == "ccq-gate"
               else ", exactly as its twin continues without it")) if spec.ccq else "")
           + f": synthetic fraction {settings.synthetic_fraction:g}, up to "
           f"{settings.max_questions} questions per recall document, the values' bytes weighted "
           f"{settings.answer_weight:g}x in the loss"
           + (f"; frozen: the parameters matching `{settings.freeze}`" if settings.freeze else "") + "."]
          if info.get("init") else []),
        f"- Steps: {settings.steps}; batch: {settings.batch_size} sequences; tokens seen: {tm['tokens_seen']:,}"
        + (f" (with the earlier stages: {tm['tokens_seen'] + sum(r['train']['tokens_seen'] for r in stages):,})."
           if stages else "."),
        f"- Optimiser: AdamW (lr {settings.lr:g}, betas ({settings.beta1}, {settings.beta2}), eps 1e-8, weight decay "
        f"{settings.weight_decay} on linear-layer matrices), {settings.warmup_steps} warmup steps then cosine to "
        f"{settings.min_lr_ratio:g} x lr, gradient clipping at {settings.grad_clip}; "
        + ("bf16 autocast with fp32 master weights" if settings.device.startswith("cuda") else "fp32")
        + f"; seed {settings.seed}.",
        (f"- Final train loss: {tm['final_train_loss']:.4f} nats/byte (mean of the last {tm['final_train_loss_steps']} "
         f"steps; first step {tm['first_train_loss']:.4f})."),
        f"- Wall time: {tm['train_seconds']:.1f} s training ({tm['tokens_per_s_overall']:,.0f} tokens/s overall"
        + (f", {steady:,.0f} tokens/s after the first {settings.log_every} steps" if steady else "")
        + f"), {info['total_seconds']:.1f} s in all with evaluation and saving.",
        f"- Hardware: {info['hardware']}.",
        "- Software: " + ", ".join(f"{k} {v}" for k, v in info["software"].items()) + ".",
        f"- Code: commit {info['git_commit']}.",
        "",
        "## Held-out evaluation (the saved weights, fp32)",
        "",
        (f"- Held-out loss: {mm['heldout_nll_per_byte']:.4f} nats/byte ({mm['heldout_bits_per_byte']:.3f} bits/byte), "
         f"perplexity {mm['heldout_perplexity']:.2f} per byte; a uniform byte model has 256. "
         f"{settings.eval_windows} windows of {settings.context} + 1 bytes from the eval split of sotu, kjv and "
         f"austen, spread evenly over each corpus, the same for every model ({mm['heldout_scored_bytes']:,} "
         "scored bytes; list in train_log.json)."),
        (f"- In-distribution recall: {mm['recall_exact_match']:.1%} of the "
         f"{mm.get('recall_answers', mm['recall_docs'])} "
         f"answers in {mm['recall_docs']} held-out synthetic recall documents (our training wording, eval-split "
         f"filler, {settings.context} bytes long) have every byte of the value predicted correctly (teacher-forced "
         f"argmax); value NLL {mm['recall_value_nll_per_byte']:.3f} nats/byte. This is not S-NIAH; S-NIAH's "
         "numbers are in the project's results."),
        "",
        "## Reproduce",
        "",
        *(["Each stage in turn, `--init-from` naming the folder the stage before wrote (here `models`):", ""]
          if stages else []),
        "```",
        *(record["command"] for record in stages),
        "".join(f"{k}={v} " for k, v in info.get("environment", {}).items()) + info["command"],
        "```",
        "",
        ("Same seed on the same hardware and software: identical data and initial weights; on CPU the losses are "
         "bit-identical, on GPU fla's triton kernels (autotuned) may change the last bits. Full loss curve: "
         "train_log.json."),
        "",
    ]
    return "\n".join(lines)


def config_summary(model) -> str:
    c = model.config
    if c.model_type == "llama":
        return (f"hidden {c.hidden_size}, {c.num_hidden_layers} layers, {c.num_attention_heads} heads of "
                f"{c.hidden_size // c.num_attention_heads}, MLP {c.intermediate_size}")
    parts = [f"hidden {c.hidden_size}", f"{c.num_hidden_layers} layers", f"{c.num_heads} heads"]
    block = model.base_model.layers[0]  # fla's blocks hold their token mixer as `attn` (Mamba2: `mixer`)
    layer = getattr(block, "attn", None) or block.mixer
    if hasattr(layer, "head_k_dim"):
        parts.append(f"head_k {layer.head_k_dim}, head_v {layer.head_v_dim}")
    else:
        parts.append(f"head_dim {layer.head_dim}, state {layer.ssm_state_size}")
    if getattr(block, "mlp", None) is not None:
        parts.append(f"MLP {block.mlp.intermediate_size}")
    if getattr(c, "use_short_conv", False):
        parts.append(f"short conv {c.conv_size}")
    return ", ".join(parts)
