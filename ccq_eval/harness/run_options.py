"""The options of `ccq-eval run` as planning takes them, and the command line that reproduces them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# The seed of `ccq-eval run` and `ccq-eval inspect` when none is given: one value, so that inspect looks at the
# prompts a run evaluates. It stays 0, the seed every committed result under results/ was made with.
DEFAULT_SEED = 0


@dataclass
class RunOptions:
    """What `ccq-eval run` was asked (plan.plan_run validates and resolves it)."""

    models: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    lengths: str | None = None
    depths: str | None = None
    samples_per_cell: int | None = None
    limit: float | None = None
    device: str = "auto"  # resolve_device
    dtype: str | None = "auto"  # resolve_dtype
    batch_size: int | None = None  # None: the adapter's auto (from free memory on the fast path, else 1)
    max_length: int | None = None
    seed: int = DEFAULT_SEED
    output: Path = Path("results/latest")
    lm_eval_args: list[str] = field(default_factory=list)
    longbench_dir: Path | None = None
    qa_dir: Path | None = None  # SQuAD v2 / HotpotQA files of the RULER QA tasks (else the hub)
    zeroshot_dir: Path | None = None  # <task>/<split>.jsonl files of the zero-shot suite (else hub / cache)
    rolling_windows: str | None = None  # wikitext's protocol in the zero-shot suite: "hflm" (None) or "carry"
    recall_dir: Path | None = None  # <dataset>/validation.jsonl files of the recall tasks (else hub / cache)
    recall_protocol: str | None = None  # the recall table's rules: "jrt" (None) or "lm-eval"
    recall_length: int | None = None  # jrt: tokens the document is cut to (None: 2048)
    recall_prompt: str | None = None  # jrt: "once" (None) or "twice" (the document read twice)
    keep_going: bool = False
    cuda_graphs: bool | None = None  # CUDA-graph decode and scoring; None: where they apply (adapter)
    suite: str | None = None  # a name in suites.SUITES: its tasks and lengths instead of --task / --lengths
    shard: str | None = None  # "K/N": this worker runs the K-th of N deterministic parts of the units
    ccq_attach: str | None = (
        None  # "lambda=0,1,2;order=2": each model once per lambda, CCQ attached (options)
    )


def options_command_line(options: RunOptions) -> list[str]:
    """The `ccq-eval run` command that reproduces `options` (stored in every unit's meta.json)."""
    argv = ["ccq-eval", "run"]
    for model in options.models:
        argv += ["--model", model]
    for task in options.tasks:
        argv += ["--task", task]
    if options.suite is not None:
        argv += ["--suite", options.suite]
    for flag, value in (
        ("--lengths", options.lengths),
        ("--depths", options.depths),
        ("--samples-per-cell", options.samples_per_cell),
        ("--limit", options.limit),
        ("--dtype", options.dtype),
        ("--max-length", options.max_length),
        ("--longbench-dir", options.longbench_dir),
        ("--qa-dir", options.qa_dir),
        ("--zeroshot-dir", options.zeroshot_dir),
        ("--rolling-windows", options.rolling_windows),
        ("--recall-dir", options.recall_dir),
        ("--recall-protocol", options.recall_protocol),
        ("--recall-length", options.recall_length),
        ("--recall-prompt", options.recall_prompt),
    ):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--device", options.device]
    if options.batch_size is not None:
        argv += ["--batch-size", str(options.batch_size)]
    argv += ["--seed", str(options.seed), "--output", str(options.output)]
    for pair in options.lm_eval_args:
        argv += ["--lm-eval-arg", pair]
    if options.shard is not None:
        argv += ["--shard", options.shard]
    if options.ccq_attach is not None:
        argv += ["--ccq-attach", options.ccq_attach]
    if options.keep_going:
        argv.append("--keep-going")
    if options.cuda_graphs is not None:
        argv.append("--cuda-graphs" if options.cuda_graphs else "--no-cuda-graphs")
    return argv
