"""Construction pieces shared by S-NIAH (tasks/s_niah/utils.py) and RULER's multi-needle NIAH tasks
(tasks/ruler_niah/utils.py): keys and values, per-cell random generators, sentence splitting, the
essay and noise haystacks, token counting and the exact-fit search, metadata parsing, tokenizer
loading and RULER's scoring.

Facts follow NVIDIA RULER scripts/data/synthetic/niah.py and constants.py, scoring
scripts/eval/synthetic/constants.py (commit named in tasks/s_niah/README.md). The task hooks, which
lm-eval loads by file path, import this module from the installed package as
ccq_eval.tasks.s_niah.construction; it holds no module-level state.
"""

from __future__ import annotations

import bisect
import difflib
import logging
import random
import re
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ccq_eval.errors import UserError

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------- RULER facts
# RULER's needle (niah.py); it keeps the plural kind ("numbers" / "uuids") whatever the template's
# number: RULER formats needles before it singularises the template for one needle.
NEEDLE = "One of the special magic {kinds} for {key} is: {value}."
# Noise haystack unit (S-NIAH-1): one line of these five sentences; lines are joined with "\n".
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
GENERATION_BUDGET = 128  # RULER's tokens_to_generate for niah; also max_gen_toks in the YAML

# ---------------------------------------------------------------- grid defaults
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
# Ten depths evenly spaced over [0, 100] %, rounded to integers as RULER rounds its 40 depths:
# round(linspace(0, 100, 10)) = 0, 11, 22, 33, 44, 56, 67, 78, 89, 100.
DEFAULT_DEPTHS = tuple(round(100 * i / 9) for i in range(10))
DEFAULT_SAMPLES_PER_CELL = 1
DEFAULT_SEED = 42
DEFAULT_HAYSTACK_CORPUS = "sotu"  # eval split of the State of the Union corpus (RULER: Paul Graham essays)

# Lengths with a per-length metric acc_<length> declared in the task YAML (lm-eval needs every
# metric declared up front): every multiple of 1024 up to 128K, plus 256, 512, 256K, 512K, 1M.
METRIC_LENGTHS = tuple(sorted({256, 512, 262144, 524288, 1048576} | {1024 * k for k in range(1, 129)}))

KNOWN_METADATA = {
    "lengths", "max_seq_lengths", "depths", "samples_per_cell", "seed", "tokenizer", "pretrained", "haystack",
    "tokenizer_name", "max_length",  # lm-eval merges --model_args (max_length, ...) into every task's metadata
}


class NiahError(UserError, ValueError):
    """Bad NIAH settings (S-NIAH or RULER's multi-needle tasks); the message says what is wrong and
    what to use instead."""


SNiahError = NiahError  # the name S-NIAH's hooks and their callers use


# ---------------------------------------------------------------- keys and values
def load_key_words(path: Path = HERE / "key_words.txt") -> list[str]:
    """Sorted unique "<adjective>-<noun>" keys from the shipped word list (RULER's key form)."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return sorted({f"{adj}-{noun}" for adj in sections["adjectives"] for noun in sections["nouns"]})


def draw_value(rng: random.Random, kinds: str) -> str:
    if kinds == "numbers":  # RULER: str(random.randint(10**6, 10**7 - 1)), 7 digits
        return str(rng.randint(10**6, 10**7 - 1))
    if kinds == "uuids":  # RULER: uuid.UUID(int=random.getrandbits(128), version=4)
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise NiahError(f"unknown value kind {kinds!r}: use 'numbers' or 'uuids'")


def cell_rng(
    seed: int, task: str, length: int, depth: float, index: int, family: str = "ccq-s-niah"
) -> random.Random:
    # One generator per grid cell and sample: a cell's needle does not change when other
    # lengths or depths are added to the grid. str seeds are hashed with SHA-512 by random,
    # so this is stable across processes and PYTHONHASHSEED.
    return random.Random(f"{family}|{seed}|{task}|{length}|{depth}|{index}")


# ---------------------------------------------------------------- sentences (no nltk)
_ABBREVIATIONS = {
    "mr", "mrs", "ms", "dr", "st", "jr", "sr", "gen", "col", "gov", "sen", "rep", "hon", "messrs", "mt", "ft",
    "no", "vol", "vs", "etc", "e.g", "i.e", "cf", "al", "inc", "co", "corp", "ltd", "jan", "feb", "mar", "apr",
    "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "capt", "lt", "prof", "rev", "u.s", "u.s.a",
}
_CLOSERS = "\"')]}\u201d\u2019"
_OPENERS = "\"'([{\u201c\u2018"


def ends_sentence(word: str, next_word: str) -> bool:
    """Whether a sentence ends between two whitespace-separated words (a stand-in for nltk's
    punkt, which RULER uses): the word ends in . ! or ? (before closing quotes/brackets), is not
    a known abbreviation or a single-letter initial, and the next word starts like a sentence
    (capital letter or digit, possibly after an opening quote or bracket)."""
    core = word.rstrip(_CLOSERS)
    if not core or core[-1] not in ".!?":
        return False
    if core[-1] == ".":
        stem = core[:-1].lstrip(_OPENERS).lower()
        if stem in _ABBREVIATIONS or (len(stem) == 1 and stem.isalpha()):
            return False
    start = next_word.lstrip(_OPENERS)
    return bool(start) and (start[0].isupper() or start[0].isdigit())


def sentence_ends(words: list[str]) -> list[int]:
    """Indices i such that a sentence ends after words[i] (the last word is not listed)."""
    return [i for i in range(len(words) - 1) if ends_sentence(words[i], words[i + 1])]


def split_sentences(text: str) -> list[str]:
    """Split single-space-separated text into sentences; " ".join(result) == text."""
    words = text.split(" ")
    sentences, start = [], 0
    for end in sentence_ends(words):
        sentences.append(" ".join(words[start : end + 1]))
        start = end + 1
    sentences.append(" ".join(words[start:]))
    return sentences


# ---------------------------------------------------------------- haystacks
class EssayHaystack:
    """RULER's essay haystack: all text whitespace-normalised and split into words; n units are
    the first n words (the word list repeats when n exceeds it), sentence-split, and the needle
    goes in at sentence int(n_sentences * depth / 100)."""

    unit = "word"

    def __init__(self, text: str, source: str):
        self.words = re.sub(r"\s+", " ", text).strip().split(" ")
        if len(self.words) < 2:
            raise NiahError(f"haystack {source} has too little text (fewer than 2 words)")
        self.source = source
        self._ends: list[int] = []
        self._ends_for = 0

    def _words(self, n: int) -> list[str]:
        if n <= len(self.words):
            return self.words[:n]
        repeats = -(-n // len(self.words))
        return (self.words * repeats)[:n]

    def _ends_upto(self, n: int) -> list[int]:
        # Sentence ends depend only on neighbouring words, so those of a prefix are the
        # ends of the whole (repeated) word list below n - 1: compute once, reuse for every n.
        if n > self._ends_for:
            size = max(n, 2 * self._ends_for, 4096)
            self._ends = sentence_ends(self._words(size))
            self._ends_for = size
        return self._ends[: bisect.bisect_left(self._ends, n - 1)]

    def context(self, n: int, depth: float, needle: str) -> str:
        return self.context_and_offset(n, depth, needle)[0]

    def context_and_offset(self, n: int, depth: float, needle: str) -> tuple[str, int]:
        """The context and the character offset of the needle in it."""
        context, (offset,) = self.context_and_offsets(n, [(depth, needle)])
        return context, offset

    def context_and_offsets(self, n: int, needles: Sequence[tuple[float, str]]) -> tuple[str, list[int]]:
        """The context with several (depth, needle) pairs, and each needle's character offset in it
        (in the order given). Each needle goes before sentence int(n_sentences * depth / 100);
        needles are laid out in order of depth (equal depths: in the order given)."""
        words = self._words(n)
        ends = self._ends_upto(n)
        n_sentences = len(ends) + 1
        # RULER joins [sentences, needle, sentences, ..., needle, sentences] with " ", even when a
        # run of sentences is empty: depth 0 starts the context with a space, depth 100 ends it with
        # one, and two needles before the same sentence are two spaces apart.
        parts, needle_parts, start = [], {}, 0
        for i in sorted(range(len(needles)), key=lambda i: needles[i][0]):
            position = int(n_sentences * (needles[i][0] / 100))
            split_word = 0 if position == 0 else (n if position >= n_sentences else ends[position - 1] + 1)
            parts.append(" ".join(words[start:split_word]))
            needle_parts[i] = len(parts)
            parts.append(needles[i][1])
            start = split_word
        parts.append(" ".join(words[start:]))
        part_offsets = [0]
        for part in parts[:-1]:
            part_offsets.append(part_offsets[-1] + len(part) + 1)
        return " ".join(parts), [part_offsets[needle_parts[i]] for i in range(len(needles))]


class NoiseHaystack:
    """RULER's noise haystack: n copies of NOISE_LINE joined by newlines; the needle becomes its
    own line, inserted before line int(n * depth / 100)."""

    unit = "line"
    source = "noise"

    def context(self, n: int, depth: float, needle: str) -> str:
        return self.context_and_offset(n, depth, needle)[0]

    def context_and_offset(self, n: int, depth: float, needle: str) -> tuple[str, int]:
        """The context and the character offset of the needle in it."""
        lines = [NOISE_LINE] * n
        before = int(n * (depth / 100))
        lines.insert(before, needle)
        return "\n".join(lines), before * (len(NOISE_LINE) + 1)


def essay_haystack(spec: str) -> EssayHaystack:
    """Haystack text from an embedded corpus (its eval split, in corpus order) or a user's file."""
    from ccq_eval.data.corpora import CorpusError, resolve_corpus

    try:
        docs = resolve_corpus(spec, split="eval")
    except CorpusError as err:
        raise NiahError(f"haystack: {err}") from None
    return EssayHaystack("\n\n".join(doc.text for doc in docs), source=spec)


# ---------------------------------------------------------------- token counts and sizing
def prompt_token_count(tokenizer: Any, text: str) -> int:
    """Tokens the model sees for a prompt, counted as the ccq adapter feeds it: BOS when the
    tokenizer has one, then the text encoded without special tokens."""
    bos = 1 if getattr(tokenizer, "bos_token_id", None) is not None else 0
    return bos + len(tokenizer.encode(text, add_special_tokens=False, verbose=False))


def fit_haystack(count: Callable[[int], int], target: int, guess: int) -> int:
    """Largest number of haystack units n >= 1 with count(n) <= target: a few secant steps from
    `guess` (tokens grow about linearly with units), then galloping and bisection. The result
    always satisfies count(n) <= target < count(n + 1), i.e. the prompt is within one haystack
    unit of the target even where count is not strictly monotone. Every count is a full
    tokenisation of a prompt, so the secant steps keep their number small at long lengths.
    Raises ValueError when one unit already exceeds the target (the caller words the error)."""
    base = count(1)
    if base > target:
        raise ValueError("one unit exceeds the target")
    n = max(1, guess)
    for _ in range(3):
        if n == 1:
            break
        per_unit = (count(n) - base) / (n - 1)
        if per_unit <= 0:
            break
        estimate = max(1, 1 + int((target - base) / per_unit))
        if abs(estimate - n) <= 1:
            break
        n = estimate
    if count(n) <= target:
        lo, step = n, 1
        while count(lo + step) <= target:
            lo += step
            step *= 2
        hi = lo + step
    else:
        hi, step = n, 1
        lo = max(1, hi - step)
        while count(lo) > target:
            hi = lo
            step *= 2
            lo = max(1, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo



def fit_to_length(count: Callable[[int], int], *, length: int, guess: int, task: str, unit: str) -> int:
    """fit_haystack for a nominal length: the most haystack units n with count(n) + GENERATION_BUDGET
    <= length. A length too small for one unit raises NiahError naming the minimum length."""
    try:
        return fit_haystack(count, length - GENERATION_BUDGET, guess)
    except ValueError:
        minimum = count(1) + GENERATION_BUDGET
        raise NiahError(
            f"length {length} is too small for {task}: with one haystack {unit} the prompt takes "
            f"{count(1)} tokens of this tokenizer and the generation budget is {GENERATION_BUDGET}, so the "
            f"minimum length is {minimum}"
        ) from None

# ---------------------------------------------------------------- scoring (RULER string_match_all)
_CONTROL_CHARS = re.compile(r"[\x00-\x1f]")


def postprocess_prediction(text: str) -> str:
    # RULER evaluate.py postprocess_pred: strip, control characters -> newline, strip.
    return _CONTROL_CHARS.sub("\n", text.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Percentage of references found case-insensitively in the prediction (one sample)."""
    pred = prediction.lower()
    return 100.0 * sum(ref.lower() in pred for ref in references) / len(references)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    score = string_match_all(postprocess_prediction(results[0]), doc["outputs"])
    return {"acc": score, f"acc_{doc['length']}": score}


def doc_to_text(doc: dict) -> str:
    return doc["input"]


def doc_to_target(doc: dict) -> str:
    return " ".join(doc["outputs"])


# ---------------------------------------------------------------- metadata
def _int_list(value: Any, key: str) -> list[int]:
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    try:
        out = [int(str(v).strip()) for v in items]
    except ValueError:
        raise NiahError(f"metadata {key}={value!r}: expected integers, e.g. [1024, 2048]") from None
    if not out:
        raise NiahError(f"metadata {key} is empty: give at least one value")
    return out


def _depth_list(value: Any) -> list[float]:
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    try:
        depths = [float(str(v).strip()) for v in items]
    except ValueError:
        raise NiahError(f"metadata depths={value!r}: expected numbers in [0, 100], e.g. [0, 50, 100]") from None
    bad = [d for d in depths if not 0 <= d <= 100]
    if not depths or bad:
        raise NiahError(f"metadata depths={value!r}: each depth is a percentage in [0, 100]")
    return [int(d) if d.is_integer() else d for d in depths]


def parse_grid(metadata: dict[str, Any], family: str = "S-NIAH") -> dict[str, Any]:
    """The grid and settings from task metadata (defaults filled in); `family` names the tasks in messages."""
    for key in metadata:
        if key not in KNOWN_METADATA:
            close = difflib.get_close_matches(key, sorted(KNOWN_METADATA), n=1, cutoff=0.8)
            if close:
                log.warning("%s metadata key %r is not used; did you mean %r?", family, key, close[0])
    lengths = _int_list(metadata.get("lengths", metadata.get("max_seq_lengths", DEFAULT_LENGTHS)), "lengths")
    unsupported = [n for n in lengths if n not in METRIC_LENGTHS]
    if unsupported:
        raise NiahError(
            f"lengths {unsupported} have no per-length metric: use multiples of 1024 up to 131072, "
            f"or 256, 512, 262144, 524288, 1048576"
        )
    depths = _depth_list(metadata.get("depths", DEFAULT_DEPTHS))
    samples = _int_list(metadata.get("samples_per_cell", DEFAULT_SAMPLES_PER_CELL), "samples_per_cell")
    if len(samples) != 1 or samples[0] < 1:
        raise NiahError(f"metadata samples_per_cell={metadata.get('samples_per_cell')!r}: one integer >= 1")
    seed = _int_list(metadata.get("seed", DEFAULT_SEED), "seed")
    if len(seed) != 1:
        raise NiahError(f"metadata seed={metadata.get('seed')!r}: one integer")
    tokenizer = metadata.get("tokenizer") or metadata.get("pretrained")
    if not isinstance(tokenizer, str) or not tokenizer:
        raise NiahError(
            f"{family} sizes prompts in the evaluated model's tokens: pass metadata "
            "tokenizer=<local tokenizer folder or name loadable offline, or 'byt5'> (or pretrained=<model folder>)"
        )
    return {
        "lengths": sorted(set(lengths)),
        "depths": list(dict.fromkeys(depths)),
        "samples_per_cell": samples[0],
        "seed": seed[0],
        "tokenizer": tokenizer,
        # What the documents record as their tokenizer: ccq-eval passes a name that holds on every machine
        # (a registered model's name, or a folder's name with its checkpoint fingerprint); a bare path
        # given to lm-eval is recorded as given.
        "tokenizer_name": str(metadata.get("tokenizer_name") or tokenizer),
        "haystack": str(metadata.get("haystack", DEFAULT_HAYSTACK_CORPUS)),
    }


def load_tokenizer(spec: str) -> Any:
    """'byt5' (byte level, no files needed) or a tokenizer folder / name that loads offline."""
    import transformers

    if spec.lower() in ("byt5", "bytes", "byte"):
        return transformers.ByT5Tokenizer()
    from ccq_eval.logs import transformers_errors_only
    from ccq_eval.model.registry import registered_folder

    path = registered_folder(spec) or Path(spec)
    if path.is_file():  # e.g. .../tokenizer.model or tokenizer.json: load its folder
        path = path.parent
    # Only a hub id (owner/name) is looked up on the hub: any other name would retry it for minutes.
    hub_id = not path.exists() and spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    try:
        # transformers reads the checkpoint's config.json on the way and warns that a model type it does not
        # know (gla, ccq_gla) instantiates a config of type ``: noise for a tokenizer
        with transformers_errors_only():
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path) if path.exists() else spec,
                                                                   local_files_only=not hub_id)
    except Exception as err:  # noqa: BLE001  (any loader failure gets the same advice)
        reason = " ".join(str(err).split())
        raise NiahError(
            f"could not load tokenizer {spec!r} offline ({type(err).__name__}: {reason}); pass metadata "
            "tokenizer=<folder with tokenizer.json / tokenizer.model> or 'byt5'"
        ) from None
    probe = tokenizer.encode("The grass is green.", add_special_tokens=False)
    if not probe or all(t == tokenizer.unk_token_id for t in probe):
        raise NiahError(f"tokenizer {spec!r} encodes English text to nothing or <unk>: it did not load properly")
    return tokenizer


def as_dataset(docs: list[dict]) -> dict:
    """lm-eval custom_dataset result: the docs as the test split."""
    import datasets

    return {"test": datasets.Dataset.from_list(docs)}

