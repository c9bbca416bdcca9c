"""Which lm-eval tasks a run evaluates: --task names, a suite's or the defaults resolved through the task
catalog, checked against the options their families take (ccq_eval.task_families), with the tasks whose
data is absent left out where a larger name asked for them (a suite, the `ruler` alias), each with a note
that says which and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ccq_eval.harness.fingerprints import (
    hub_offline,
    hub_reachable,
    hub_unreachable,
    longbench_data_present,
    qa_data_names,
    qa_data_present,
)
from ccq_eval.harness.options import ParsedOptions, PlanError
from ccq_eval.harness.suites import SuitePart
from ccq_eval.harness.task_registry import TaskCatalog
from ccq_eval.task_families import (
    FAMILIES,
    PERPLEXITY,
    RECALL,
    RECALL_LMEVAL_TASKS,
    RECALL_PAPER_COLUMNS,
    ZEROSHOT,
    family_of,
)

# The default run's tasks, and those of its CCQ sweep (model_resolution.DEFAULT_SWEEP_ATTACH's lambdas).
DEFAULT_TASKS = ["s-niah", "ppl"]
DEFAULT_SWEEP_TASKS = ["s-niah-1", "s-niah-2", "ppl-sweep"]


@dataclass
class RunTasks:
    """The lm-eval tasks of a run, each with the name it was asked by, and what was decided about them."""

    resolved: list[tuple[str, str]]
    sweep_tasks: list[tuple[str, str]]  # the default sweep models' tasks (DEFAULT_SWEEP_TASKS)
    part_of: dict[str, SuitePart]  # lm-eval task -> its suite part
    notes: list[str]


def select_tasks(parsed: ParsedOptions, catalog: TaskCatalog, *, with_sweep: bool) -> RunTasks:
    """The run's tasks (--task, a suite's or the defaults) resolved, and the options checked against their
    families."""
    options, grid, suite = parsed.options, parsed.grid, parsed.suite
    task_names = [a for part in suite.parts for a in part.tasks] if suite else list(options.tasks or DEFAULT_TASKS)
    resolved = resolve_tasks(task_names, catalog)  # (lm-eval task, as the user wrote it)
    sweep_tasks = [pair for pair in resolve_tasks(DEFAULT_SWEEP_TASKS, catalog) if pair[0] in dict(resolved)] \
        if with_sweep else []
    notes: list[str] = []
    part_of: dict[str, SuitePart] = {}
    if suite is not None:
        for part in suite.parts:
            for task, alias in resolved:
                if alias in part.tasks:
                    part_of[task] = part
        resolved, notes = _suite_tasks_with_data(resolved, part_of, parsed)
    resolved, qa_notes = _qa_tasks_with_data(resolved, parsed)
    notes += qa_notes
    resolved, zeroshot_notes = _zeroshot_tasks_with_data(resolved, part_of, parsed, catalog)
    notes += zeroshot_notes
    resolved, recall_notes = _recall_tasks_with_data(resolved, part_of, parsed)
    notes += recall_notes
    if grid.depths is not None and not any(family_of(task).takes_depths for task, _ in resolved):
        with_depths = ", ".join(family.title for family in FAMILIES if family.takes_depths)
        raise PlanError(f"--depths applies only to tasks that place their needles at a depth ({with_depths}), "
                        "and none was selected; leave --depths out or add such a task")
    grid_tasks = [task for task, _ in resolved if family_of(task).length_grid]
    _check_lengths(grid_tasks, grid.lengths, options.lengths)
    _check_lm_eval_args_apply(resolved, parsed.lm_eval_args)
    if options.limit is not None and grid_tasks:
        raise PlanError(
            f"--limit takes the first N documents, which for {grid_tasks[0]} are the shortest lengths only; "
            "use --samples-per-cell for S-NIAH and perplexity tasks (and --limit in a separate LongBench run)"
        )
    longbench_tasks = [task for task, _ in resolved if family_of(task).needs_longbench_data]
    if options.samples_per_cell is not None and longbench_tasks and suite is None:
        raise PlanError(
            "--samples-per-cell does not apply to LongBench (fixed datasets); run LongBench separately "
            "and use --limit N to evaluate its first N records per dataset"
        )
    _check_longbench_data(longbench_tasks, parsed.longbench_dir)
    ppl_tasks = [task for task, _ in resolved if family_of(task) is PERPLEXITY]
    if ppl_tasks and grid.samples_per_cell is None and suite is None:
        notes.append(f"note: {', '.join(ppl_tasks)} without --samples-per-cell scores every document of the "
                     "eval split at each length (tens of minutes on a CPU); --samples-per-cell 4 makes a quick "
                     "run")
    return RunTasks(resolved, sweep_tasks, part_of, notes)


# Perplexity lengths above this are checked against the embedded corpora (which takes seconds to read).
_PPL_LENGTH_CHECKED_ABOVE = 1 << 20


def _check_lengths(grid_tasks: list[str], lengths: list[int] | None, given: str | None) -> None:
    """--lengths the tasks can build documents and metrics for, checked here so that a bad one stops the
    run before a model loads (the tasks' own checks run only once lm-eval builds them): S-NIAH's and RULER's
    tasks declare acc_<length> for 256, 512, multiples of 1024 up to 128K, 256K, 512K and 1M; perplexity
    needs 2 tokens and, by default, no more than its embedded corpora hold."""
    if not lengths or not grid_tasks:
        return
    from ccq_eval.tasks.s_niah.construction import METRIC_LENGTHS

    for task in grid_tasks:
        if family_of(task) is PERPLEXITY:
            bad, wanted = [n for n in lengths if n < 2], "at least 2 tokens"
            if not bad and max(lengths) > _PPL_LENGTH_CHECKED_ABOVE:
                most = _embedded_eval_bytes()
                bad = [n for n in lengths if n > most]
                wanted = f"at most {most} tokens (what its embedded corpora hold at one token per byte)"
        else:
            bad = [n for n in lengths if n not in METRIC_LENGTHS]
            wanted = "256, 512, a multiple of 1k up to 128k, 256k, 512k or 1024k (its per-length metrics)"
        if bad:
            raise PlanError(f"--lengths {given or ','.join(map(str, lengths))}: {task} takes {wanted}, not "
                            f"{', '.join(map(str, bad))} tokens; give such lengths, e.g. --lengths 1k,2k,4k")


def _check_lm_eval_args_apply(resolved: list[tuple[str, str]], lm_eval_args: dict) -> None:
    """--lm-eval-arg gen_kwargs when no task of the run generates, or num_fewshot when every task's config fixes
    it at 0, is ignored by lm-eval but recorded in the units' settings: refused, naming the tasks. A run that
    mixes tasks which use it with tasks which do not passes (lm-eval applies it where it can). Tasks whose
    config is not at hand (lm-eval's, beyond the zero-shot suite) are left to lm-eval."""
    gen_kwargs, shots = lm_eval_args.get("gen_kwargs"), lm_eval_args.get("num_fewshot")
    if not gen_kwargs and shots in (None, 0):
        return
    from ccq_eval.harness.task_registry import declared_config

    configs = {task: declared_config(task) for task, _ in resolved}
    if any(config is None for config in configs.values()):
        return
    if gen_kwargs and all(config.get("output_type", "generate_until") != "generate_until"
                          for config in configs.values()):
        kinds = ", ".join(f"{task}: {config.get('output_type')}" for task, config in configs.items())
        raise PlanError(f"--lm-eval-arg gen_kwargs: no task of this run generates ({kinds}), so lm-eval would "
                        "ignore gen_kwargs while the units record them; drop the argument")
    if shots not in (None, 0) and all(config.get("num_fewshot") == 0 for config in configs.values()):
        raise PlanError(f"--lm-eval-arg num_fewshot={shots}: the config of {', '.join(configs)} fixes "
                        "num_fewshot at 0, so lm-eval would ignore it while the units record it; drop the argument")


def _embedded_eval_bytes() -> int:
    """The UTF-8 bytes of the embedded corpora's eval split: more tokens than any tokenizer makes of them."""
    from ccq_eval.data.corpora import list_corpora, load_corpus

    return sum(len(doc.text.encode("utf-8")) + 2 for name in list_corpora()  # + a BOS and an EOS per document
               for doc in load_corpus(name, split="eval"))


def resolve_tasks(names: list[str], catalog: TaskCatalog) -> list[tuple[str, str]]:
    """Task aliases or lm-eval names -> (lm-eval task, the name it was asked by), each task once."""
    resolved: list[tuple[str, str]] = []
    for name in names:
        try:
            expanded = catalog.resolve(name)
        except KeyError as exc:
            message = str(exc)
            if type(exc) is KeyError:  # a bare KeyError: list the choices ourselves
                choices = ", ".join(sorted(catalog.aliases()))
                message = (f"unknown task {name!r}; valid choices: {choices} (or an lm-eval task name "
                           "from `lm-eval ls tasks`)")
            raise PlanError(message) from None
        for task in expanded:
            if task not in [t for t, _ in resolved]:
                resolved.append((task, name))
    return resolved


def _suite_tasks_with_data(resolved: list[tuple[str, str]], part_of: dict[str, SuitePart],
                           parsed: ParsedOptions) -> tuple[list[tuple[str, str]], list[str]]:
    """A suite's tasks without the LongBench datasets whose data is absent, and notes saying so."""
    data_dir, suite = parsed.longbench_dir, parsed.options.suite
    kept = [(task, alias) for task, alias in resolved
            if not part_of[task].needs_longbench_data or (data_dir and longbench_data_present(task, data_dir))]
    dropped = sorted({alias for task, alias in resolved if (task, alias) not in kept})
    notes = []
    if dropped and data_dir is None:
        notes.append(f"--suite {suite}: {', '.join(dropped)} skipped (no --longbench-dir)")
    elif dropped:
        missing = len(resolved) - len(kept)
        notes.append(f"--suite {suite}: {missing} {'/'.join(dropped)} datasets skipped "
                     f"(no jsonl file in {data_dir})")
    return kept, notes


def _check_longbench_data(tasks: list[str], data_dir: Path | None) -> None:
    """LongBench reads the official jsonl files: their folder must be given and hold every file asked for."""
    if not tasks:
        return
    if data_dir is None:
        raise PlanError(f"{tasks[0]} needs the LongBench data: pass --longbench-dir FOLDER holding the official "
                        "jsonl files (the unzipped data.zip of the hub dataset THUDM/LongBench)")
    folder = Path(data_dir).expanduser()
    missing = [task for task in tasks if task.startswith("ccq_longbench_") and not longbench_data_present(task, folder)]
    if missing:
        raise PlanError(f"--longbench-dir {data_dir} lacks the jsonl file of {', '.join(missing[:3])}"
                        f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} (looked in it and its "
                        "data/ subfolder): unzip THUDM/LongBench's data.zip there, or choose fewer tasks")


def _qa_tasks_with_data(resolved: list[tuple[str, str]],
                        parsed: ParsedOptions) -> tuple[list[tuple[str, str]], list[str]]:
    """The RULER QA tasks read SQuAD v2 / HotpotQA files from --qa-dir, or fetch them from the hub. One whose
    data is in neither is left out with a note when a larger name asked for it (a suite, or an alias such as
    `ruler` that names other tasks too), and is a PlanError when it was asked for itself."""
    qa_dir = parsed.qa_dir
    qa_tasks = [(task, alias) for task, alias in resolved if family_of(task).needs_qa_data]
    if not qa_tasks or (qa_dir is None and not hub_offline() and hub_reachable()):
        return resolved, []  # without --qa-dir the tasks fetch their data from the hub
    absent = [(task, alias) for task, alias in qa_tasks if qa_dir is None or not qa_data_present(task, qa_dir)]
    if not absent:
        return resolved, []
    files = ", ".join(qa_data_names(task) for task, _ in absent)
    if qa_dir is None and hub_offline():
        why = (f"no --qa-dir holds their data ({files}) and the hub is off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE "
               "is set); pass --qa-dir FOLDER holding those files, or unset those variables to fetch them from "
               "the hub")
    elif qa_dir is None:
        why = (f"no --qa-dir holds their data ({files}) and the hub cannot be reached from here; pass --qa-dir "
               "FOLDER holding those files")
    else:
        why = f"--qa-dir {qa_dir} lacks {files}; add the file there, or choose fewer tasks"
    names = " and ".join(task for task, _ in absent)
    wider = {alias for task, alias in resolved if not family_of(task).needs_qa_data}
    if parsed.suite is None and not all(alias in wider for _, alias in absent):
        raise PlanError(f"{names} cannot run: {why}")
    return [pair for pair in resolved if pair not in absent], [f"left out {names}: {why}"]


def _zeroshot_tasks_with_data(resolved: list[tuple[str, str]], part_of: dict[str, SuitePart], parsed: ParsedOptions,
                              catalog: TaskCatalog) -> tuple[list[tuple[str, str]], list[str]]:
    """The zero-shot suite's tasks read lm-eval's datasets from --zeroshot-dir, the hub or the datasets cache.
    One whose data none of them holds is left out with a note where its suite part allows it (--suite paper)
    and stops the run otherwise, with zeroshot.ZeroshotDataError's one line (dataset and how to fetch it)."""
    from ccq_eval.harness.zeroshot import HFLM_ROLLING_TASKS

    tasks = [(task, alias) for task, alias in resolved if family_of(task) is ZEROSHOT]
    if parsed.options.rolling_windows is not None and not any(task in HFLM_ROLLING_TASKS for task, _ in tasks):
        rolling = ", ".join(sorted(HFLM_ROLLING_TASKS))
        raise PlanError(f"--rolling-windows sets how the zero-shot suite scores {rolling}, and no such task was "
                        "selected; drop it, or add -t wikitext (or -t zeroshot)")
    if not tasks:
        return resolved, []
    from ccq_eval.harness import zeroshot

    manager = catalog.make_task_manager({})
    absent: list[tuple[str, str]] = []
    for task, alias in tasks:
        try:
            zeroshot.check_data(manager, [task], parsed.zeroshot_dir)
        except zeroshot.ZeroshotDataError as error:
            if not (task in part_of and part_of[task].left_out_without_data):
                raise PlanError(str(error)) from None
            absent.append((task, alias))
    if not absent:
        return resolved, []
    where = f"--zeroshot-dir {parsed.zeroshot_dir}" if parsed.zeroshot_dir else "no --zeroshot-dir"
    names = "zeroshot" if len(absent) == len(tasks) else ", ".join(task for task, _ in absent)
    found_nowhere = ("the hub cannot be reached from here (HF_HUB_OFFLINE=1 reads the datasets cache)"
                     if hub_unreachable() else "neither the hub nor the datasets cache holds the data")
    note = (f"--suite {parsed.options.suite}: {names} skipped ({where}, and {found_nowhere}; docs/zeroshot.md says "
            "how to get it)")
    return [pair for pair in resolved if pair not in absent], [note]


# Our jrt recall task -> lm-eval's own task on the same dataset (None: lm-eval has no version with the document
# in the prompt; its triviaqa, nq_open and drop are closed-book or prompted otherwise).
RECALL_LMEVAL_NAMES = {ours: lmeval for ours, lmeval, _ in RECALL_PAPER_COLUMNS}


def _recall_protocol_tasks(resolved: list[tuple[str, str]], parsed: ParsedOptions) -> tuple[list[tuple[str, str]],
                                                                                           list[str]]:
    """Under --recall-protocol lm-eval, our recall tasks become lm-eval's own swde, fda and squad_completion;
    those lm-eval has no version of are left out with a note where a larger name asked for them (the `recall`
    alias, a suite), and stop the run where they were asked by name."""
    if parsed.options.recall_protocol != "lm-eval":
        return resolved, []
    mapped: list[tuple[str, str]] = []
    without: list[str] = []
    for task, alias in resolved:
        if family_of(task) is not RECALL or task in RECALL_LMEVAL_TASKS:
            mapped += [(task, alias)] if (task, alias) not in mapped else []
        elif RECALL_LMEVAL_NAMES.get(task):
            mapped.append((RECALL_LMEVAL_NAMES[task], alias))
        elif alias == task:
            raise PlanError(f"{task} has no lm-eval version (lm-eval's triviaqa, nq_open and drop are closed-book "
                            "or prompted otherwise): run it with --recall-protocol jrt")
        else:
            without.append(task)
    notes = [f"--recall-protocol lm-eval: {', '.join(without)} left out (lm-eval ships only swde, fda and "
             "squad_completion with the document in the prompt)"] if without else []
    return mapped, notes


def _recall_tasks_with_data(resolved: list[tuple[str, str]], part_of: dict[str, SuitePart],
                            parsed: ParsedOptions) -> tuple[list[tuple[str, str]], list[str]]:
    """The recall tasks under the asked protocol, each with its dataset found: the --recall-dir file (every
    row checked now, so a bad row stops the run before anything is written), else the hub or the datasets
    cache. Tasks whose data no source holds are left out with one note where their suite part allows it
    (--suite paper), and otherwise stop the run with one line naming every missing dataset."""
    from ccq_eval.tasks.recall import data as recall_data

    resolved, notes = _recall_protocol_tasks(resolved, parsed)
    options = parsed.options
    tasks = [(task, alias) for task, alias in resolved if family_of(task) is RECALL]
    asked = [flag for flag, value in (("--recall-protocol", options.recall_protocol),
                                      ("--recall-length", options.recall_length),
                                      ("--recall-prompt", options.recall_prompt)) if value is not None]
    if asked and not tasks:
        raise PlanError(f"{', '.join(asked)} set how the recall tasks run, and no recall task was selected; drop "
                        "them, or add -t recall")
    ours = [task for task, _ in tasks if task not in RECALL_LMEVAL_TASKS]
    if (options.recall_length is not None or options.recall_prompt is not None) and not ours:
        raise PlanError("--recall-length and --recall-prompt apply to our jrt recall tasks (ccq_recall_*), and only "
                        f"lm-eval's own {', '.join(task for task, _ in tasks)} were selected; drop them")
    missing: list[tuple[str, str, recall_data.RecallDataset]] = []
    prompt_mode = options.recall_prompt or "once"
    for task, alias in tasks:
        try:
            dataset = recall_data.dataset_for(task, options.recall_length)
            path = recall_data.local_file(dataset, parsed.recall_dir)
            if path is not None:
                recall_data.read_file(path, dataset, prompt_mode if task in ours else "once")
                continue
        except recall_data.RecallDataError as error:
            raise PlanError(str(error)) from None
        if not _hub_dataset_found(dataset):
            missing.append((task, alias, dataset))
    if not missing:
        return resolved, notes
    datasets = list(dict.fromkeys(dataset for _, _, dataset in missing))
    if not all(task in part_of and part_of[task].left_out_without_data for task, _, _ in missing):
        raise PlanError(recall_data.missing_data_message(datasets))
    absent = [(task, alias) for task, alias, _ in missing]
    where = f"--recall-dir {parsed.recall_dir}" if parsed.recall_dir else "no --recall-dir"
    names = "recall" if len(absent) == len(tasks) else ", ".join(task for task, _ in absent)
    notes.append(f"--suite {options.suite}: {names} skipped ({where}, and neither the hub nor the datasets cache "
                 f"holds {', '.join(dataset.hub_id for dataset in datasets)}; docs/recall.md says how to get them)")
    return [pair for pair in resolved if pair not in absent], notes


def _hub_dataset_found(dataset) -> bool:
    """Whether `datasets` finds a recall dataset's builder: on the hub when it may be and can be reached, else
    in the datasets cache (HF_HUB_OFFLINE). An allowed but unreachable hub finds nothing (no retries)."""
    if hub_unreachable():
        return False
    import datasets

    try:
        datasets.load_dataset_builder(dataset.hub_id, dataset.hub_config)
    except Exception:  # noqa: BLE001  (any failure to find it: the data is missing)
        return False
    return True
