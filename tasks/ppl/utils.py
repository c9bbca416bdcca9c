"""Length-extrapolation perplexity: documents, metrics and the two task classes.

Two protocols (tasks.md; README.md in this folder says where they differ from the reference):

* ccq_ppl_buckets (fla evals/ppl.py, GLA paper figure): the tokenised corpus is one stream,
  cut into blocks of `block_length` tokens; each block is one model input scored in one
  pass; NLL is summed per position bucket of `bucket_size` tokens.
* ccq_ppl_sweep (YaRN's eval script, Gated DeltaNet figure): for each length L, every
  document of at least L tokens contributes its first L tokens; perplexity per L.

Both cut documents in the evaluated model's tokens, so they need the model's tokenizer
(metadata `tokenizer` or `pretrained`). A model input is exactly L tokens: when the tokenizer
has a BOS, the adapter prepends it to L - 1 text tokens and every text token is scored;
without a BOS the text has L tokens and the first one is unscored context. Either way a
block gives L - 1 predictions, the i-th made with i + 1 tokens of context, which is the
position fla's buckets use.

Metric values per document are (nll_sum, n_tokens) pairs, so the aggregated perplexity is
token-weighted (exp of total NLL over total tokens) and the per-sample log keeps the sums.

Any lm-eval model runs both tasks. The ccq adapter returns per-token NLLs (its TokenNLL), which the
position buckets need; another model (lm-eval's `hf`) returns one summed log-likelihood of every text
token, which gives every metric except the buckets (README.md in this folder says how its numbers
differ).
"""

from __future__ import annotations

import logging
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import datasets
from lm_eval.api.metrics import mean
from lm_eval.api.task import ConfigurableTask

logger = logging.getLogger(__name__)

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 20480)
DEFAULT_BUCKET_SIZE = 2048
# All embedded corpora, held-out split: about 1.2M tokens, 14 documents over 20K tokens.
DEFAULT_CORPUS = "sotu,kjv,austen"
BYTE_TOKENIZER_NAMES = ("byt5", "bytes", "byte")


# --------------------------------------------------------------------------- metadata parsing
def parse_lengths(value: Any) -> list[int]:
    """[1024, 2048] from a list of ints or a string "1k,2k" / "1024,2048" (k = 1024)."""
    if value is None:
        return list(DEFAULT_LENGTHS)
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    lengths = []
    for item in items:
        text = str(item).strip().lower()
        match = re.fullmatch(r"(\d+)(k?)", text)
        if not match:
            raise ValueError(f"ppl lengths: cannot read {item!r}; give token counts like 4096 or 4k")
        lengths.append(int(match.group(1)) * (1024 if match.group(2) else 1))
    if not lengths or min(lengths) < 2:
        raise ValueError(f"ppl lengths must be at least 2 tokens each, got {value!r}")
    return sorted(set(lengths))


def block_length_of(metadata: dict[str, Any]) -> int:
    if metadata.get("block_length") is not None:
        length = int(metadata["block_length"])
        if length < 2:
            raise ValueError(f"ppl block_length must be at least 2 tokens, got {length}")
        return length
    return max(parse_lengths(metadata.get("lengths")))


def bucket_size_of(metadata: dict[str, Any], block_length: int) -> int:
    # fla's 2048, shrunk for short blocks so there are always at least 4 buckets.
    size = metadata.get("bucket_size")
    size = int(size) if size is not None else max(1, min(DEFAULT_BUCKET_SIZE, block_length // 4))
    if size < 1:
        raise ValueError(f"ppl bucket_size must be positive, got {size}")
    return size


def bucket_ranges(block_length: int, bucket_size: int) -> list[tuple[int, int]]:
    """Position ranges [start, end) of the predictions in a block of `block_length` tokens.

    Position i is the i-th prediction (made with i + 1 tokens of context); a block has
    block_length - 1 of them, so the last bucket holds one fewer than its nominal size."""
    n_predictions = block_length - 1
    n_buckets = max(1, math.ceil(n_predictions / bucket_size))
    return [(k * bucket_size, min((k + 1) * bucket_size, block_length)) for k in range(n_buckets)]


def _max_count(metadata: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        if metadata.get(key) is not None:
            count = int(metadata[key])
            if count < 1:
                raise ValueError(f"ppl {key} must be a positive count, got {count}")
            return count
    return None


# --------------------------------------------------------------------------- tokenizer
@lru_cache(maxsize=8)
def _tokenizer_by_name(name: str):
    if name.lower() in BYTE_TOKENIZER_NAMES:
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer()
    from transformers import AutoTokenizer

    from ccq_eval.logs import transformers_errors_only
    from ccq_eval.model.registry import registered_folder

    folder = registered_folder(name) or Path(name).expanduser()
    if folder.is_dir():
        with transformers_errors_only():  # no "model of type ``" warning for fla's / our model types
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return AutoTokenizer.from_pretrained(name)


def get_tokenizer(metadata: dict[str, Any]):
    """The evaluated model's tokenizer, from metadata `tokenizer` or `pretrained`: a registry
    name, a checkpoint folder, a hub id, "byt5", or a tokenizer object."""
    for key in ("tokenizer", "pretrained"):
        value = metadata.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            return value  # a tokenizer object handed over in Python
        return _tokenizer_by_name(value)
    raise ValueError(
        "ppl tasks cut documents in the evaluated model's tokens and need its tokenizer: pass task "
        "metadata tokenizer=<model name, checkpoint folder, hub id, or 'byt5'> (ccq-eval run sets it; "
        "with lm-eval, model_args pretrained=... is forwarded when no task_manager is given)")


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _decode(tokenizer, ids: list[int]) -> str:
    # Keep special tokens (document separators) as text: the adapter's tokenizer reads them back.
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# --------------------------------------------------------------------------- documents
def _split_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [part.strip() for part in str(value).split(",") if part.strip()]


def load_documents(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    """(doc id, text) pairs from, in this order of precedence: metadata `data_files` (.txt
    files, .jsonl files with a "text" field, or folders of .txt; comma-separated), `hf_dataset`
    (hub or local dataset: `hf_name`, `hf_split` default test, `text_field` default text), or
    `corpus` (embedded corpora, comma-separated names, split `corpus_split`, default eval)."""
    from ccq_eval.data.corpora import load_corpus, read_user_corpus

    documents: list[tuple[str, str]] = []
    if _split_list(metadata.get("data_files")):
        for path in _split_list(metadata.get("data_files")):
            documents += [(f"{Path(path).name}:{doc.id}", doc.text) for doc in read_user_corpus(path)]
    elif metadata.get("hf_dataset"):
        text_field = str(metadata.get("text_field") or "text")
        dataset = datasets.load_dataset(str(metadata["hf_dataset"]), metadata.get("hf_name"),
                                        split=str(metadata.get("hf_split") or "test"))
        if text_field not in dataset.column_names:
            raise ValueError(f"hf_dataset {metadata['hf_dataset']} has no column {text_field!r}; columns: "
                             f"{dataset.column_names} (set metadata text_field)")
        documents = [(str(i), str(row[text_field])) for i, row in enumerate(dataset)]
    else:
        split = str(metadata.get("corpus_split") or "eval")
        for name in _split_list(metadata.get("corpus") or DEFAULT_CORPUS):
            documents += [(f"{name}:{doc.id}", doc.text) for doc in load_corpus(name, split=split)]
    # Surrounding whitespace would merge into the separator tokens when the blocks' text is read
    # back (special tokens strip spaces next to them), so documents are stripped.
    documents = [(doc_id, text.strip()) for doc_id, text in documents if text.strip()]
    if not documents:
        raise ValueError("ppl: the document source is empty")
    return documents


def _source_name(metadata: dict[str, Any]) -> str:
    if _split_list(metadata.get("data_files")):
        return "files:" + ",".join(Path(p).name for p in _split_list(metadata.get("data_files")))
    if metadata.get("hf_dataset"):
        return f"hf:{metadata['hf_dataset']}"
    return "corpus:" + ",".join(_split_list(metadata.get("corpus") or DEFAULT_CORPUS))


def _content_length(tokenizer, length: int) -> int:
    """Text tokens per model input of `length` tokens (the adapter adds BOS when there is one)."""
    return length - 1 if getattr(tokenizer, "bos_token_id", None) is not None else length


def _round_trips(tokenizer, ids: list[int]) -> bool:
    return _encode(tokenizer, _decode(tokenizer, ids)) == ids


def _character_cut(tokenizer, ids: list[int], n_tokens: int) -> int:
    """Where to end a piece of at most `n_tokens` of `ids`: the longest of the last four candidates
    whose text round-trips exactly, so that a byte-level tokenizer never cuts inside a UTF-8
    character (its partial bytes would be lost in the text the adapter receives); `n_tokens` when
    none does (SentencePiece edges that merge differently keep their text)."""
    n_tokens = min(n_tokens, len(ids))
    for cut in range(n_tokens, max(n_tokens - 4, 0), -1):
        if _round_trips(tokenizer, ids[:cut]):
            return cut
    return n_tokens


def _doc(tokenizer, ids: list[int], **fields: Any) -> dict[str, Any]:
    text = _decode(tokenizer, ids)
    # Decoding then re-encoding may merge tokens differently at the edges; record it, the
    # scorer uses the number of tokens it actually scored. Lost text is an error, not a record.
    exact = _encode(tokenizer, text) == ids
    if not exact and ("\ufffd" in text or type(tokenizer).__name__.startswith("ByT5")):
        raise ValueError(
            f"ppl: a piece of {fields.get('source')} (document {fields.get('document', fields.get('block_index'))}) "
            "loses bytes when its tokens become text (a cut inside a character); its score would cover "
            "other tokens than counted: use another tokenizer or corpus, or report this with the document")
    return {"text": text, "n_text_tokens": len(ids), "roundtrip_exact": exact, **fields}


def bucket_documents(**metadata: Any) -> dict[str, datasets.Dataset]:
    """custom_dataset of ccq_ppl_buckets: the corpus as one token stream, cut into blocks."""
    tokenizer = get_tokenizer(metadata)
    block_length = block_length_of(metadata)
    bucket_size = bucket_size_of(metadata, block_length)
    max_blocks = _max_count(metadata, "max_blocks", "samples_per_cell")
    n_text = _content_length(tokenizer, block_length)
    # Document boundaries as the tokenizer's own convention marks them (fla tokenises each
    # document with its special tokens): BOS before each document, or EOS after it.
    bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    blocks = []
    for _, text in load_documents(metadata):
        ids = _encode(tokenizer, text)
        stream.extend(([bos] if bos is not None else []) + ids + ([eos] if bos is None and eos is not None else []))
        while len(stream) >= n_text and (max_blocks is None or len(blocks) < max_blocks):
            cut = _character_cut(tokenizer, stream, n_text)  # the rest of a character opens the next block
            blocks.append(stream[:cut])
            stream = stream[cut:]
        if max_blocks is not None and len(blocks) >= max_blocks:
            break
    if not blocks:
        raise ValueError(f"ppl buckets: the documents hold fewer than {n_text} tokens, not one block of "
                         f"{block_length}; use a shorter block_length / lengths or more documents")
    source = _source_name(metadata)
    rows = [_doc(tokenizer, block, block_index=index, length=block_length, bucket_size=bucket_size,
                 source=source) for index, block in enumerate(blocks)]
    return {"test": datasets.Dataset.from_list(rows)}


def sweep_documents(**metadata: Any) -> dict[str, datasets.Dataset]:
    """custom_dataset of ccq_ppl_sweep: for each length L, the first L tokens of every document
    that has at least L (documents in source order, at most `max_docs_per_length` each)."""
    tokenizer = get_tokenizer(metadata)
    lengths = parse_lengths(metadata.get("lengths"))
    max_docs = _max_count(metadata, "max_docs_per_length", "samples_per_cell")
    documents = [(doc_id, _encode(tokenizer, text)) for doc_id, text in load_documents(metadata)]
    source = _source_name(metadata)
    rows = []
    for length in lengths:
        n_text = _content_length(tokenizer, length)
        kept = [(doc_id, ids) for doc_id, ids in documents if len(ids) >= n_text]
        if max_docs is not None:
            kept = kept[:max_docs]
        if not kept:
            logger.warning("ppl sweep: no document has %d tokens; length %d has no samples", n_text, length)
        rows.extend(_doc(tokenizer, ids[:_character_cut(tokenizer, ids, n_text)], length=length, document=doc_id,
                         source=source) for doc_id, ids in kept)
    if not rows:
        raise ValueError(f"ppl sweep: no document reaches the shortest length {lengths[0]} tokens")
    return {"test": datasets.Dataset.from_list(rows)}


# --------------------------------------------------------------------------- metrics
def perplexity_of_pairs(items: list[tuple[float, int]]) -> float:
    """Token-weighted perplexity: exp(sum of NLL / number of tokens) over (nll_sum, n) pairs."""
    nll = math.fsum(float(pair[0]) for pair in items)
    count = sum(int(pair[1]) for pair in items)
    return math.exp(nll / count) if count else float("nan")


def sum_of(items: list[float]) -> float:
    return math.fsum(float(x) for x in items)


def count_of(items: list[int]) -> int:
    return sum(int(x) for x in items)


def _token_nll(results: list[Any]) -> list[float] | None:
    """The per-token NLLs of the ccq adapter's TokenNLL; None for another model's plain float."""
    token_nll = getattr(results[0], "token_nll", None)
    return None if token_nll is None else list(token_nll)


def _summed_nll(results: list[Any], doc: dict[str, Any]) -> tuple[float, int]:
    """(NLL sum, scored tokens) of a plain loglikelihood_rolling float: another lm-eval model scores every
    token of the document's text, n_text_tokens when its tokenizer is the task's."""
    value = float(results[0])
    if not math.isfinite(value):
        raise ValueError(f"ppl: the model returned a log-likelihood of {value} for document "
                         f"{doc.get('document', doc.get('block_index'))}; a finite number is needed")
    return -value, int(doc["n_text_tokens"])


def _metrics_for(name: str, nll: float, count: int) -> dict[str, Any]:
    return {f"ppl{name}": (nll, count), f"nll{name}": nll, f"tokens{name}": count}


def bucket_results(token_nll: list[float], block_length: int, bucket_size: int) -> dict[str, Any]:
    """Per-document metric values of ccq_ppl_buckets. Predictions beyond the nominal block
    (when re-encoding the decoded text added tokens) count in the last bucket."""
    ranges = bucket_ranges(block_length, bucket_size)
    sums = [0.0] * len(ranges)
    counts = [0] * len(ranges)
    for position, value in enumerate(token_nll):
        bucket = min(position // bucket_size, len(ranges) - 1)
        sums[bucket] += value
        counts[bucket] += 1
    out = _metrics_for("", math.fsum(token_nll), len(token_nll))
    for (start, end), nll, count in zip(ranges, sums, counts, strict=True):
        out.update(_metrics_for(f"@{start}-{end}", nll, count))
    return out


def sweep_results(token_nll: list[float], length: int) -> dict[str, Any]:
    return _sweep_metrics(math.fsum(token_nll), len(token_nll), length)


def _sweep_metrics(nll: float, count: int, length: int) -> dict[str, Any]:
    out = _metrics_for(f"@{length}", nll, count)
    out[f"docs@{length}"] = 1
    # YaRN's script reports the mean over documents of each document's perplexity
    out[f"doc_ppl@{length}"] = math.exp(nll / count) if count else float("nan")
    return out


class _PerplexityTask(ConfigurableTask):
    """ConfigurableTask whose metric names depend on the lengths in the task metadata
    (declared here at construction, since YAML metric_list is static)."""

    def __init__(self, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        config = dict(config or {})
        config.pop("class", None)
        super().__init__(config=config, **kwargs)
        self._metric_fn_list = {}
        self._metric_fn_kwargs = {}
        self._aggregation_list = {}
        self._higher_is_better = {}
        for suffix in self.metric_suffixes():
            self._declare(suffix)

    @property
    def task_metadata(self) -> dict[str, Any]:
        metadata = self.config.metadata
        return dict(metadata) if isinstance(metadata, dict) else {}

    def metric_suffixes(self) -> list[str]:
        raise NotImplementedError

    def _declare(self, suffix: str) -> None:
        for prefix, aggregation, higher in (("ppl", perplexity_of_pairs, False), ("nll", sum_of, False),
                                            ("tokens", count_of, True)):
            self._aggregation_list[prefix + suffix] = aggregation
            self._higher_is_better[prefix + suffix] = higher


class BucketPerplexityTask(_PerplexityTask):
    def metric_suffixes(self) -> list[str]:
        block_length = block_length_of(self.task_metadata)
        bucket_size = bucket_size_of(self.task_metadata, block_length)
        return [""] + [f"@{start}-{end}" for start, end in bucket_ranges(block_length, bucket_size)]

    def process_results(self, doc: dict[str, Any], results: list[Any]) -> dict[str, Any]:
        token_nll = _token_nll(results)
        if token_nll is None:  # one sum, no positions: the whole block's metrics only
            return _metrics_for("", *_summed_nll(results, doc))
        return bucket_results(token_nll, int(doc["length"]), int(doc["bucket_size"]))


class SweepPerplexityTask(_PerplexityTask):
    def metric_suffixes(self) -> list[str]:
        return [f"@{length}" for length in parse_lengths(self.task_metadata.get("lengths"))]

    def _declare(self, suffix: str) -> None:
        super()._declare(suffix)
        self._aggregation_list["docs" + suffix] = count_of
        self._higher_is_better["docs" + suffix] = True
        self._aggregation_list["doc_ppl" + suffix] = mean  # lm-eval's mean: gets a standard error
        self._higher_is_better["doc_ppl" + suffix] = False

    def process_results(self, doc: dict[str, Any], results: list[Any]) -> dict[str, Any]:
        token_nll = _token_nll(results)
        if token_nll is None:
            return _sweep_metrics(*_summed_nll(results, doc), int(doc["length"]))
        return sweep_results(token_nll, int(doc["length"]))
