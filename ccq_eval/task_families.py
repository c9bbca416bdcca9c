"""The task families: what each kind of task of ours is, which metrics it reports and how it is tabulated.

One table, read by planning (which task metadata can change a task's documents, which options apply),
the tables and the report (which metric is primary, which pivots show a family) and resuming (the
document keys that name a cell):

    family_of("ccq_s_niah_2")     -> S_NIAH
    family_of("ccq_ppl_sweep")    -> PERPLEXITY
    family_of("hellaswag")        -> ZEROSHOT (lm-eval's own task, claimed by exact name)
    family_of("ccq_recall_swde")  -> RECALL (as are lm-eval's own swde, fda, squad_completion)
    family_of("mmlu")             -> OTHER (any other lm-eval task)
    family_of("ccq_new_thing")    -> UnknownTaskFamilyError (a task of ours without an entry here)

Our lm-eval tasks are recognised by the start of their name (ccq_s_niah, ccq_ppl, ccq_longbench_e,
ccq_longbench); names of other harnesses are never guessed from substrings. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from ccq_eval.errors import UserError

OUR_TASK_PREFIX = "ccq_"
# Keys under which a task's documents name their cell (the first one present wins).
LENGTH_KEYS = ("length", "max_length", "seq_length", "context_length", "target_length")
DEPTH_KEYS = ("depth", "depth_percent", "needle_depth")
# The run's task metadata keys that only some families record in their units' spec (TaskFamily.metadata_keys);
# every other key (the seed) is recorded for every task.
FAMILY_METADATA_KEYS = ("lengths", "depths", "samples_per_cell", "data_dir", "qa_dir", "zeroshot_dir", "recall_dir",
                        "recall_length", "recall_prompt")


class UnknownTaskFamilyError(UserError, ValueError):
    """A task name of ours (ccq_...) that no family in FAMILIES claims."""


@dataclass(frozen=True)
class FamilyTable:
    """One pivot the paper tables show for a family: which pivot (tables.PIVOTS), its title and note."""

    pivot: str
    title: str
    note: str = ""


@dataclass(frozen=True)
class TaskFamily:
    """One family of tasks and everything the harness and the analysis decide by it.

    name: the tidy frame's `family` column; task_prefixes: how our lm-eval task names of the family
    begin (the longest matching prefix wins); request_type: the lm-eval request its tasks send;
    metrics: the base metrics its tasks report (per-length and per-bucket variants are suffixed:
    acc_1024, ppl@4096, ppl@0-512, score_0-4k); primary_metric: the one tables and comparisons show
    where a task reports it (else, and for None, the task's first metric); higher_is_better: that metric's
    direction (None: as the task says);
    metadata_keys: which of FAMILY_METADATA_KEYS its units' spec records (those that can change its
    documents; OTHER keeps lengths and samples_per_cell, which lm-eval hands every task); length_grid:
    its documents form a grid of nominal lengths (--lengths, --samples-per-cell); cell_rows: per-length and
    per-(length, depth) values are recomputed from the documents' cell keys; bucket_metrics: overall
    metrics named <metric>_<bucket> are per-length-bucket values; tables: the pivots that show it, in order.
    """

    name: str
    title: str
    task_prefixes: tuple[str, ...]
    request_type: str
    metrics: tuple[str, ...]
    primary_metric: str | None
    higher_is_better: bool | None
    metadata_keys: frozenset[str] = frozenset()
    length_grid: bool = False
    cell_rows: bool = False
    bucket_metrics: bool = False
    tables: tuple[FamilyTable, ...] = ()
    display_label: str = ""
    # Other harnesses' tasks the family claims by exact name (never by prefix), and per-task primary metrics
    # where they differ from primary_metric: (task, metric) pairs.
    task_names: tuple[str, ...] = ()
    task_primary_metrics: tuple[tuple[str, str], ...] = ()

    def primary_metric_for(self, task: str) -> str | None:
        """The metric tables and comparisons show for `task`: its own entry in task_primary_metrics, else
        the family's primary_metric."""
        return dict(self.task_primary_metrics).get(task, self.primary_metric)

    @property
    def takes_depths(self) -> bool:
        return "depths" in self.metadata_keys

    @property
    def needs_longbench_data(self) -> bool:
        """Whether its documents come from the official LongBench jsonl files (--longbench-dir)."""
        return "data_dir" in self.metadata_keys

    @property
    def needs_qa_data(self) -> bool:
        """Whether its documents come from SQuAD / HotpotQA files (--qa-dir, or the hub)."""
        return "qa_dir" in self.metadata_keys


S_NIAH = TaskFamily(
    name="s-niah",
    title="S-NIAH",
    task_prefixes=("ccq_s_niah",),
    request_type="generate_until",
    metrics=("acc",),
    primary_metric="acc",
    higher_is_better=True,
    metadata_keys=frozenset({"lengths", "depths", "samples_per_cell"}),
    length_grid=True,
    cell_rows=True,
    display_label="S-NIAH-",
    tables=(
        FamilyTable(
            "per_length",
            "S-NIAH accuracy per length",
            "accuracy (RULER string match, %) per nominal length; depth x length cells in `--view tidy`",
        ),
    ),
)
def _ruler_family(name: str, title: str, task_prefixes: tuple[str, ...], display_label: str,
                  metadata_keys: frozenset[str], table_title: str, note: str) -> TaskFamily:
    """A RULER family beyond S-NIAH: generate_until tasks scored by RULER's string match (acc, acc_<L>) on a
    grid of nominal lengths, whose per-length cells are recomputed from the documents."""
    return TaskFamily(
        name=name, title=title, task_prefixes=task_prefixes, request_type="generate_until", metrics=("acc",),
        primary_metric="acc", higher_is_better=True, metadata_keys=metadata_keys, length_grid=True,
        cell_rows=True, display_label=display_label, tables=(FamilyTable("per_length", table_title, note),),
    )


_GRID_KEYS = frozenset({"lengths", "depths", "samples_per_cell"})
RULER_NIAH = _ruler_family(
    "niah", "NIAH with competitors", ("ccq_niah_", "ccq_ruler_niah"), "NIAH ", _GRID_KEYS,
    "RULER multi-key / multi-value / multi-query NIAH accuracy per length",
    "accuracy (RULER string match, %) per nominal length; depth = the target needle's")
RULER_VT = _ruler_family(
    "ruler-vt", "variable tracking", ("ccq_ruler_vt",), "RULER ", _GRID_KEYS,
    "RULER variable tracking accuracy per length", "accuracy (RULER string match, %); depth = the first variable's")
RULER_AGGREGATION = _ruler_family(
    "ruler-aggregation", "common / frequent words", ("ccq_ruler_cwe", "ccq_ruler_fwe", "ccq_ruler_aggregation"),
    "RULER ", _GRID_KEYS - {"depths"}, "RULER word extraction accuracy per length",
    "accuracy (RULER string match, %); no target position, so no depth")
RULER_QA = _ruler_family(
    "ruler-qa", "RULER QA", ("ccq_ruler_qa",), "RULER QA ", _GRID_KEYS | {"qa_dir"},
    "RULER QA accuracy per length", "RULER string_match_part, %; depth = the gold document's")
PERPLEXITY = TaskFamily(
    name="ppl",
    title="perplexity",
    task_prefixes=("ccq_ppl",),
    request_type="loglikelihood_rolling",
    metrics=("ppl", "nll", "tokens", "docs", "doc_ppl"),
    primary_metric="ppl",
    higher_is_better=False,
    metadata_keys=frozenset({"lengths", "samples_per_cell"}),
    length_grid=True,
    tables=(
        FamilyTable("per_length", "Perplexity per length (truncated-document sweep)", "lower is better"),
        FamilyTable(
            "per_position_bucket",
            "Perplexity per position bucket (position-bucketed protocol)",
            "column = end of the bucket in tokens; lower is better",
        ),
    ),
)
LONGBENCH = TaskFamily(
    name="longbench",
    title="LongBench",
    task_prefixes=("ccq_longbench",),
    request_type="generate_until",
    metrics=("score",),
    primary_metric="score",
    higher_is_better=True,
    metadata_keys=frozenset({"data_dir"}),
    display_label="LongBench ",
    tables=(FamilyTable("longbench_categories", "LongBench per dataset with category averages"),),
)
LONGBENCH_E = TaskFamily(
    name="longbench-e",
    title="LongBench-E",
    task_prefixes=("ccq_longbench_e",),
    request_type="generate_until",
    metrics=("score",),
    primary_metric="score",
    higher_is_better=True,
    metadata_keys=frozenset({"data_dir"}),
    bucket_metrics=True,
    display_label="LongBench-E ",
    tables=(FamilyTable("per_length_bucket", "LongBench-E per length bucket"),),
)
# lm-eval's own zero-shot suite of the GLA / Gated DeltaNet papers: fla's README command (wikitext ...
# openbookqa) plus social_iqa, which the Gated DeltaNet paper reports. The papers' metrics: HellaSwag and
# ARC-Challenge acc_norm, wikitext word perplexity, LAMBADA perplexity and accuracy, the others acc.
ZEROSHOT_TASKS = ("wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge",
                  "boolq", "sciq", "copa", "openbookqa", "social_iqa")
ZEROSHOT = TaskFamily(
    name="zeroshot",
    title="zero-shot downstream",
    task_prefixes=(),
    request_type="any",  # multiple_choice and loglikelihood; loglikelihood_rolling for wikitext
    metrics=("acc", "acc_norm", "perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"),
    primary_metric="acc",
    higher_is_better=None,
    metadata_keys=frozenset({"zeroshot_dir"}),
    tables=(FamilyTable("zeroshot_paper", "Zero-shot downstream (lm-eval's task configs)"),),
    task_names=ZEROSHOT_TASKS,
    task_primary_metrics=(("wikitext", "word_perplexity"), ("hellaswag", "acc_norm"), ("arc_challenge", "acc_norm")),
)
# The papers' table, in their column order: (task, metric, column header). Their average ("Avg.") is over
# the accuracy columns of the Gated DeltaNet paper's table, ZEROSHOT_AVERAGED; sciq, copa and openbookqa
# (in fla's command, not in the papers' tables) follow it.
ZEROSHOT_PAPER_COLUMNS = (
    ("wikitext", "word_perplexity", "Wiki. ppl"), ("lambada_openai", "perplexity", "LMB. ppl"),
    ("lambada_openai", "acc", "LMB. acc"), ("piqa", "acc", "PIQA acc"), ("hellaswag", "acc_norm", "Hella. acc_n"),
    ("winogrande", "acc", "Wino. acc"), ("arc_easy", "acc", "ARC-e acc"), ("arc_challenge", "acc_norm", "ARC-c acc_n"),
    ("social_iqa", "acc", "SIQA acc"), ("boolq", "acc", "BoolQ acc"), ("sciq", "acc", "SciQ acc"),
    ("copa", "acc", "COPA acc"), ("openbookqa", "acc", "OBQA acc"),
)
ZEROSHOT_AVERAGED = (("lambada_openai", "acc"), ("piqa", "acc"), ("hellaswag", "acc_norm"), ("winogrande", "acc"),
                     ("arc_easy", "acc"), ("arc_challenge", "acc_norm"), ("social_iqa", "acc"), ("boolq", "acc"))
# The recall-intensive table of the Based / JRT papers (SWDE, SQuAD, FDA, TriviaQA, NQ, DROP; reported by the
# Gated DeltaNet, GDN-2, MoM and KDA papers): ours under the JRT harness's rules (tasks/recall), and lm-eval's
# own swde, fda and squad_completion (claimed by name), which read the same datasets without the cut.
RECALL_LMEVAL_TASKS = ("swde", "fda", "squad_completion")
RECALL = TaskFamily(
    name="recall",
    title="recall-intensive",
    task_prefixes=("ccq_recall",),
    request_type="generate_until",
    metrics=("contains",),
    primary_metric="contains",
    higher_is_better=True,
    metadata_keys=frozenset({"recall_dir", "recall_length", "recall_prompt"}),
    display_label="recall ",
    tables=(FamilyTable("recall_paper", "Recall-intensive tasks (Based / JRT)"),),
    task_names=RECALL_LMEVAL_TASKS,
)
# The papers' columns in their order: (our task, lm-eval's own task or None, header); Avg. is their mean.
RECALL_PAPER_COLUMNS = (
    ("ccq_recall_swde", "swde", "SWDE"), ("ccq_recall_squad", "squad_completion", "SQD"),
    ("ccq_recall_fda", "fda", "FDA"), ("ccq_recall_triviaqa", None, "TQA"), ("ccq_recall_nq", None, "NQ"),
    ("ccq_recall_drop", None, "DROP"),
)
OTHER = TaskFamily(
    name="other",
    title="other lm-eval tasks",
    task_prefixes=(),
    request_type="any",
    metrics=(),
    primary_metric=None,
    higher_is_better=None,
    metadata_keys=frozenset({"lengths", "samples_per_cell"}),
    tables=(FamilyTable("overall", "Other tasks (overall values)"),),
)

# In the order the paper tables show them.
FAMILIES: tuple[TaskFamily, ...] = (
    S_NIAH, RULER_NIAH, RULER_VT, RULER_AGGREGATION, RULER_QA, PERPLEXITY, LONGBENCH, LONGBENCH_E, ZEROSHOT, RECALL,
    OTHER,
)
FAMILY_BY_NAME = {family.name: family for family in FAMILIES}


def family_of(task: str) -> TaskFamily:
    """The family of an lm-eval task name: ours by the longest family prefix it starts with, OTHER for a
    task that is not ours. Raises UnknownTaskFamilyError for a name of ours (ccq_...) no family claims."""
    for family in FAMILIES:
        if task in family.task_names:
            return family
    best: tuple[int, TaskFamily] | None = None
    for family in FAMILIES:
        for prefix in family.task_prefixes:
            if task.startswith(prefix) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), family)
    if best is not None:
        return best[1]
    if task.startswith(OUR_TASK_PREFIX):
        known = ", ".join(prefix for family in FAMILIES for prefix in family.task_prefixes)
        raise UnknownTaskFamilyError(
            f"task {task!r} is named like one of ours ({OUR_TASK_PREFIX}...) but belongs to no task family "
            f"(known: {known}); add its family to ccq_eval/task_families.py"
        )
    return OTHER


def is_ours(task: str) -> bool:
    """Whether an lm-eval task name is one of ours (a family other than OTHER claims it by prefix; lm-eval's own
    tasks that a family claims by name are not)."""
    family = family_of(task)
    return family is not OTHER and task not in family.task_names
