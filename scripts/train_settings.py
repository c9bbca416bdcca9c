"""What train_tiny.py trains and how: the five embedded models, the run's settings and the command line
that sets them (checked, with one line naming each bad value)."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path

import tiny_data
import torch

CONTEXT = 2048
DEFAULT_STEPS = 3000


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "gla" | "gdn" (CCQ twins) | "llama" | one of FLA_OWN_FAMILIES (baselines without a twin)
    ccq: bool
    in_default_run: bool = True  # registered with "default": true (`ccq-eval run` with no --model runs it)

    @property
    def twin(self) -> str | None:
        """The model that differs from this one only in the CCQ flag (None for a model without a CCQ twin)."""
        if self.family not in ("gla", "gdn"):
            return None
        return self.name.removesuffix("-ccq") if self.ccq else self.name + "-ccq"


MODEL_SPECS = {
    spec.name: spec
    for spec in (
        ModelSpec("tiny-gla", "gla", False),
        ModelSpec("tiny-gla-ccq", "gla", True),
        ModelSpec("tiny-gdn", "gdn", False),
        ModelSpec("tiny-gdn-ccq", "gdn", True),
        ModelSpec("tiny-transformer", "llama", False),
        ModelSpec("tiny-deltanet", "delta_net", False, in_default_run=False),
        ModelSpec("tiny-kda", "kda", False, in_default_run=False),
        ModelSpec("tiny-mamba2", "mamba2", False, in_default_run=False),
        ModelSpec("tiny-precond-gdn", "precond_gdn", False, in_default_run=False),
    )
}
# The baselines trained in fla's own classes (no CCQ twin): family -> fla model_type.
FLA_OWN_FAMILIES = {"delta_net": "delta_net", "kda": "kda", "mamba2": "mamba2",
                    "precond_gdn": "precond_gated_deltanet"}


@dataclass
class TrainSettings:
    steps: int
    batch_size: int
    context: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float
    seed: int
    synthetic_fraction: float
    curriculum_share: float
    repeat: int
    log_every: int
    eval_windows: int
    recall_docs: int
    device: str
    save_dtype: str
    smoke: bool
    data_workers: int
    code_commit: str | None = None
    max_questions: int = tiny_data.MAX_QUESTIONS
    answer_weight: float = 1.0
    init_from: str | None = None  # folder of trained checkpoints to continue from (see initial_model)
    ccq_init_lambda: float | None = None  # a continued CCQ twin's gate starts at this lambda (ccq_gate_fields)
    ccq_gate: str = "query"
    train_parts: str = "all"  # TRAIN_PARTS: which parameters the optimiser updates
    freeze: str | None = None  # regular expression: parameters whose names it matches stay frozen


# --train: "all" parameters; the "backbone" with CCQ's gate frozen at its start; only CCQ's gate
# ("ccq-gate", the backbone frozen: the read cannot be trained around, only its gate learned).
TRAIN_PARTS = ("all", "backbone", "ccq-gate")
# --freeze read-path: everything that decides what a layer's read sees, so that a twin trained through a
# fixed CCQ read cannot learn its way around it: the token embeddings and the attention input norms
# (the first layer's query and key inputs), the query and key projections and short convolutions, and
# the decay parameters (which also set CCQ's covariance window: Gated DeltaNet's a_proj, A_log, dt_bias;
# GLA's gk_proj).
FREEZE_PRESETS = {
    "read-path": r"embeddings|attn_norm|attn\.(q_proj|k_proj|q_conv1d|k_conv1d|a_proj|A_log|dt_bias|gk_proj)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODEL_SPECS),
                        help=f"comma-separated subset of {', '.join(MODEL_SPECS)} (default: all, in turn)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for <name>/ checkpoints and registry.json (default: models/ of the repo; "
                             "--smoke: a new temporary folder)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available; --smoke: cpu)")
    parser.add_argument("--steps", type=int, default=None, help=f"optimiser steps (default {DEFAULT_STEPS}; --smoke 8)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 32; --smoke 2)")
    parser.add_argument("--context", type=int, default=None,
                        help=f"training context in tokens (default {CONTEXT}; --smoke 320)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3; --smoke 1e-2)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of the steps (at least 1)")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--beta2", type=float, default=0.95)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--synthetic-fraction", type=float, default=tiny_data.SYNTHETIC_FRACTION,
                        help="probability that a drawn document is a synthetic recall document "
                             f"(default {tiny_data.SYNTHETIC_FRACTION}: about half of the tokens at ctx 2048)")
    parser.add_argument("--max-questions", type=int, default=tiny_data.MAX_QUESTIONS,
                        help=f"questions at most per synthetic recall document (default {tiny_data.MAX_QUESTIONS})")
    parser.add_argument("--answer-weight", type=float, default=1.0,
                        help="loss weight of the answers' value bytes relative to every other byte (default 1)")
    parser.add_argument("--init-from", default=None,
                        help="continue from the trained checkpoints in this folder: each twin from its family's "
                             "baseline (<folder>/tiny-gla, <folder>/tiny-gdn), the Transformer from its own")
    parser.add_argument("--ccq-init-lambda", type=float, default=None,
                        help="with --init-from: the CCQ twin's gate starts at exactly this lambda (ccq_lambda_max "
                             "= 2 x it, so a query gate learns within [0, 2 x it]); default: the config's gate")
    parser.add_argument("--ccq-gate", choices=("query", "constant"), default="query",
                        help="with --init-from: the CCQ twin's gate, lambda_max * sigmoid(a.q + b) or "
                             "lambda_max * sigmoid(b) (default query)")
    parser.add_argument("--train", choices=TRAIN_PARTS, default="all",
                        help="parameters to train: all (default); backbone (CCQ's gate frozen at its start); "
                             "ccq-gate (only CCQ's gate, the backbone frozen; for a CCQ twin with --init-from)")
    parser.add_argument("--freeze", default=None,
                        help="also keep frozen the parameters whose names match this regular expression (re.search), "
                             f"or a preset: {', '.join(FREEZE_PRESETS)} (see FREEZE_PRESETS); default none")
    parser.add_argument("--curriculum-share", type=float, default=tiny_data.CURRICULUM_SHARE,
                        help="share of the steps over which synthetic documents grow from short to the full "
                             f"context (default {tiny_data.CURRICULUM_SHARE}; 0 = no curriculum)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="cycle over the first N sequences only (default 0 = fresh data; --smoke: 2)")
    parser.add_argument("--log-every", type=int, default=None, help="steps between log lines (default 50; --smoke 1)")
    parser.add_argument("--eval-windows", type=int, default=None, help="held-out windows (default 32; --smoke 3)")
    parser.add_argument("--recall-docs", type=int, default=None,
                        help="held-out recall documents (default 64; --smoke 2)")
    parser.add_argument("--save-dtype", choices=("bf16", "fp32"), default="bf16",
                        help="dtype of the saved weights (default bf16: keeps every checkpoint under 10 MB)")
    parser.add_argument("--data-workers", type=int, default=None,
                        help="batch-building worker processes (default 2 on CUDA, 0 on CPU)")
    parser.add_argument("--code-commit", default=None,
                        help="commit to name in the model cards (default: git rev-parse HEAD, when in a checkout)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--smoke", action="store_true",
                        help="CI smoke mode: CPU, tiny shapes, a few steps on repeated data, temporary output")
    parser.add_argument("--register", action=argparse.BooleanOptionalAction, default=None,
                        help="write the trained models into <out>/registry.json (default: yes, except --smoke)")
    parser.add_argument("--register-only", action="store_true",
                        help="only (re)write <out>/registry.json entries and model cards for already trained --models")
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    smoke = args.smoke

    def pick(value, normal, smoke_value):
        return value if value is not None else (smoke_value if smoke else normal)

    device = pick(args.device, "cuda" if torch.cuda.is_available() else "cpu", "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but CUDA is not available here; use --device cpu")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise SystemExit(f"unknown --device {device!r}: use cuda, cuda:N or cpu")
    steps = pick(args.steps, DEFAULT_STEPS, 8)
    settings = TrainSettings(
        steps=steps,
        batch_size=pick(args.batch_size, 32, 2),
        context=pick(args.context, CONTEXT, 320),
        lr=pick(args.lr, 2e-3, 1e-2),
        min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else max(1, steps // 20),
        weight_decay=args.weight_decay,
        beta1=args.beta1,
        beta2=args.beta2,
        grad_clip=args.grad_clip,
        seed=args.seed,
        synthetic_fraction=args.synthetic_fraction,
        curriculum_share=args.curriculum_share,
        max_questions=args.max_questions,
        answer_weight=args.answer_weight,
        init_from=str(Path(args.init_from).resolve()) if args.init_from else None,
        ccq_init_lambda=args.ccq_init_lambda,
        ccq_gate=args.ccq_gate,
        train_parts=args.train,
        freeze=FREEZE_PRESETS.get(args.freeze, args.freeze),
        repeat=pick(args.repeat, 0, 2),
        log_every=pick(args.log_every, 50, 1),
        eval_windows=pick(args.eval_windows, 32, 3),
        recall_docs=pick(args.recall_docs, 64, 2),
        device=device,
        save_dtype=args.save_dtype,
        smoke=smoke,
        data_workers=args.data_workers if args.data_workers is not None else (2 if device.startswith("cuda") else 0),
        code_commit=args.code_commit,
    )
    problems = [f"--{name.replace('_', '-')} must be >= 1, got {getattr(settings, name)}"
                for name in ("steps", "batch_size", "log_every", "eval_windows", "recall_docs")
                if getattr(settings, name) < 1]
    if settings.max_questions < 1:
        problems.append(f"--max-questions must be >= 1, got {settings.max_questions}")
    if settings.answer_weight <= 0:
        problems.append(f"--answer-weight must be > 0, got {settings.answer_weight}")
    if not 0.0 <= settings.curriculum_share <= 1.0:
        problems.append(f"--curriculum-share must be in [0, 1], got {settings.curriculum_share}")
    if settings.ccq_init_lambda is not None and not (math.isfinite(settings.ccq_init_lambda)
                                                     and settings.ccq_init_lambda > 0):
        problems.append(f"--ccq-init-lambda must be a finite number > 0, got {settings.ccq_init_lambda}")
    if settings.train_parts == "ccq-gate" and not settings.init_from:
        problems.append("--train ccq-gate trains the gate of a CCQ twin continued with --init-from; give --init-from")
    if (settings.ccq_init_lambda is not None or settings.ccq_gate != "query") and not settings.init_from:
        problems.append("--ccq-init-lambda and --ccq-gate set the gate of a CCQ twin continued with --init-from; "
                        "give --init-from too")
    if settings.freeze is not None:
        try:
            re.compile(settings.freeze)
        except re.error as exc:
            problems.append(f"--freeze {settings.freeze!r} is not a regular expression ({exc}); give one, or a "
                            f"preset: {', '.join(FREEZE_PRESETS)}")
    if settings.context < 64:
        problems.append(f"--context must be >= 64, got {settings.context}")
    if settings.warmup_steps < 1 or settings.warmup_steps > settings.steps:
        problems.append(f"--warmup-steps must be between 1 and --steps ({settings.steps}), got {settings.warmup_steps}")
    if problems:
        raise SystemExit("; ".join(problems))
    return settings


def parse_models(text: str) -> list[ModelSpec]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODEL_SPECS]
    if unknown or not names:
        raise SystemExit(f"unknown model(s) {unknown or text!r}: choose from {', '.join(MODEL_SPECS)} "
                         "(comma-separated)")
    return [MODEL_SPECS[name] for name in dict.fromkeys(names)]
