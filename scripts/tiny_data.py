"""Training and held-out data for the embedded tiny checkpoints (used by scripts/train_tiny.py).

Everything here is a pure function of (seed, index): sequence i of the training stream is built
by its own random.Random, so the data order does not depend on batch size, process or hardware.

Training stream: documents packed into sequences of ctx + 1 byte tokens (ctx inputs, ctx
targets). Each sequence starts at a document start and is filled by drawing documents until it is
full (the last one is cut at the sequence end, documents end with EOS):
- natural English: a contiguous span of a train-split document of the embedded corpora
  (sotu, kjv, austen; every train byte equally likely as a start, snapped to a word start);
- synthetic in-context recall: 1-8 key-value records hidden in filler, then questions about some
  of them, each followed by its answer; their token spans are returned, so training can weigh
  them. The wording is our own: none of RULER's S-NIAH template, needle, answer prefix or noise
  sentences, and no key built from S-NIAH's key words, so S-NIAH measures transfer of the recall
  skill, not memorised phrasing. Filler is train-split text or a repeated line of plain sentences
  written for this script. A distance curriculum (`TrainStream(ramp=...)`) caps the size of
  synthetic documents early in training.

Held-out data comes from the eval split only, is independent of the training seed, and is the
same for every model: ctx + 1 byte windows spread evenly over each corpus, and recall documents
built the same way as the synthetic training documents but with eval-split filler.

Tokens are ByT5's byte ids: byte b -> b + 3 (pad 0, eos 1, unk 2), no BOS.
"""

from __future__ import annotations

import bisect
import math
import random
import re
import uuid
from collections import Counter
from dataclasses import dataclass
from functools import cache

import torch

from ccq_eval.data.corpora import load_corpus

CORPUS_NAMES = ("sotu", "kjv", "austen")
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
BYTE_OFFSET = 3  # ByT5: token id = byte value + 3
SYNTHETIC_FRACTION = 0.75  # probability that a drawn document is synthetic (about half the tokens)
NATURAL_SPAN = (256, 4096)  # bytes of one natural document before it is cut at the sequence end
MIN_SYNTHETIC_FILLER = 48  # a synthetic doc needs at least this much filler
MIN_SYNTHETIC_DOC = 160  # bytes; smaller spaces at a sequence end get natural text
# Distance curriculum: a synthetic document's size is drawn log-uniformly from
# [MIN_SYNTHETIC_DOC, cap]; the cap grows linearly from CURRICULUM_START bytes to the training context
# over the first CURRICULUM_SHARE of the sequences, so recall is first learnt over short distances.
CURRICULUM_START = 384
CURRICULUM_SHARE = 0.4

# Our own wording (not RULER's). What a record's value is called; a document uses one name for all
# its records most of the time, and a question may name the value differently from its record, so
# that the key, not the name, is what finds the value.
VALUE_NAMES = (
    "secret code", "access number", "lucky number", "reference code", "serial number", "pass code",
    "hidden value", "tracking number", "record number", "code word", "account number", "ticket number",
    "lock combination", "catalogue number", "entry value", "private key", "room number", "badge code",
)
RECALL_HEADERS = (
    "Read the passage below and keep track of every value it records; some of them will be asked for.",
    "The following text contains a few labelled entries. Remember them.",
    "Some entries are scattered through this passage. Questions about them come at the end.",
    "Below is a long document. Somewhere in it are codes that you will need later.",
    "Pay attention to the values listed in this text; you will be asked to repeat them.",
)
# {name} is the value's name, {key} the key, {value} the value.
RECALL_NEEDLES = (
    "The {name} for {key} is {value}.",
    "The {name} for {key} is: {value}.",
    "Note: the {name} of {key} is {value}.",
    "Remember that {key} has the {name} {value}.",
    "For {key}, the {name} is {value}.",
    "{Name} for {key}: {value}.",
    "Record: the {name} for {key} equals {value}.",
    "Keep in mind that the {name} assigned to {key} is {value}.",
    "Among the entries, the {name} listed for {key} is: {value}.",
    "Ledger entry, {key}: {value}.",
    "(The {name} given to {key} reads {value}.)",
    "Write this down: {key} -> {value}.",
)
# (question, answer prefix); the model learns to produce " {value}" after question + prefix.
RECALL_QUESTIONS = (
    ("What is the {name} for {key}?", " The {name} for {key} is"),
    ("What was the {name} of {key} in the text above?", " The {name} of {key} in the text above was"),
    ("Which {name} was recorded for {key} earlier?", " The {name} recorded for {key} earlier is"),
    ("Question: which {name} was given for {key}?", " Answer:"),
    ("Q: what was {key} paired with earlier in the text?", " A:"),
    ("Tell me the {name} of {key}.", " The {name} of {key} is"),
    ("Looking back over the passage, what {name} belongs to {key}?", " It is"),
    ("Recall the entry for {key}.", " It was"),
    ("Find the {name} that the document gives for {key}.", " The {name} for {key} given in the document is"),
)
# Short plain sentences (written for this script) from which repetitive filler lines are built.
NOISE_SENTENCES = (
    "The river runs to the sea.", "The hills stand quiet.", "The lamp is lit.", "On we walk.", "Home before dark.",
    "A bird sings on the wall.", "The bread is warm.", "The door is open.", "So it goes.", "Round and round again.",
    "The clock ticks on the shelf.", "Rain taps the glass.", "The fire is low.", "Day after day.",
    "Slowly and surely.", "The road is long.", "The cat sleeps.", "Snow falls at night.", "The bell rings twice.",
    "Leaves drift by.", "The kettle hums.", "Stars come out.", "The boat rocks gently.", "All is still.",
)
NOISE_FILLER_SHARE = 0.3
VALUE_KINDS = (("number7", 0.55), ("number", 0.15), ("uuid", 0.15), ("word", 0.15))
KEY_FORMS = (("pair", 0.7), ("word", 0.15), ("word-number", 0.15))
RECORD_COUNTS = (1, 1, 2, 2, 3, 4, 5, 6, 8)
MAX_QUESTIONS = 4
# RULER S-NIAH wording that must never appear in training text (checked in tests): its templates,
# needle, answer prefix and noise haystack.
FORBIDDEN_PHRASES = (
    "special magic", "magic number", "magic uuid", "mentioned in the provided text", "provided text",
    "One of the special", "hidden within the following text", "memorize it", "quiz you about",
    "The grass is green", "The sky is blue", "The sun is yellow", "Here we go", "There and back again",
)


def encode_bytes(text: str | bytes) -> list[int]:
    """ByT5 token ids of a text, without EOS (identical to ByT5Tokenizer(add_special_tokens=False))."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return [b + BYTE_OFFSET for b in data]


def decode_bytes(ids) -> str:
    return bytes(i - BYTE_OFFSET for i in ids if i >= BYTE_OFFSET).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TextPool:
    """The documents of one split of the embedded corpora as UTF-8 bytes, for span sampling."""

    split: str
    docs: tuple[bytes, ...]
    doc_ids: tuple[str, ...]  # "<corpus>/<doc id>"
    starts: tuple[int, ...]  # cumulative byte offsets: doc j covers [starts[j], starts[j] + len(docs[j]))
    total: int

    def locate(self, offset: int) -> int:
        return bisect.bisect_right(self.starts, offset) - 1

    def span(self, rng: random.Random, length: int) -> tuple[bytes, str]:
        """A span of up to `length` bytes from a uniformly random byte offset (snapped to a word
        start), cut at the end of its document. Returns (bytes, doc id)."""
        offset = rng.randrange(self.total)
        j = self.locate(offset)
        doc = self.docs[j]
        start = offset - self.starts[j]
        if start > 0:
            space = doc.find(b" ", start, start + 64)
            start = space + 1 if space >= 0 else start
            # Never start inside a multi-byte UTF-8 character.
            while start < len(doc) and (doc[start] & 0xC0) == 0x80:
                start += 1
        return doc[start : start + length], self.doc_ids[j]


@cache
def text_pool(split: str) -> TextPool:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    docs, ids, starts, total = [], [], [], 0
    for name in CORPUS_NAMES:
        for doc in load_corpus(name, split=split):
            data = doc.text.encode("utf-8")
            docs.append(data)
            ids.append(f"{name}/{doc.id}")
            starts.append(total)
            total += len(data)
    return TextPool(split, tuple(docs), tuple(ids), tuple(starts), total)


@cache
def s_niah_key_words() -> frozenset[str]:
    """The words S-NIAH builds its keys from: held out, so never part of a training key."""
    from ccq_eval.tasks.s_niah.utils import load_key_words

    return frozenset(word for key in load_key_words() for word in key.split("-"))


@cache
def key_vocabulary(split: str = "train") -> tuple[str, ...]:
    """Lower-case words (4-10 letters, seen at least 5 times) of a split, for keys and word values;
    S-NIAH's key words are left out."""
    counts: Counter[str] = Counter()
    for doc in text_pool(split).docs:
        counts.update(re.findall(rb"\b[a-z]{4,10}\b", doc))
    held_out = s_niah_key_words()
    return tuple(sorted(w.decode() for w, c in counts.items() if c >= 5 and w.decode() not in held_out))


def _weighted(rng: random.Random, choices) -> str:
    names, weights = zip(*choices)
    return rng.choices(names, weights=weights, k=1)[0]


def draw_key(rng: random.Random, vocab: tuple[str, ...]) -> str:
    form = _weighted(rng, KEY_FORMS)
    if form == "pair":
        return f"{rng.choice(vocab)}-{rng.choice(vocab)}"
    if form == "word":
        return rng.choice(vocab)
    return f"{rng.choice(vocab)}-{rng.randint(2, 999)}"


def draw_value(rng: random.Random, kind: str, vocab: tuple[str, ...]) -> str:
    if kind == "number7":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "number":
        digits = rng.randint(3, 9)
        return str(rng.randint(10 ** (digits - 1), 10**digits - 1))
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "word":
        return rng.choice(vocab)
    raise ValueError(f"unknown value kind {kind!r}")


@dataclass(frozen=True)
class RecallDoc:
    """A synthetic recall document: records hidden in filler, then questions, each followed by its
    answer. `answers` holds (byte offset of the answer's value in `text`, value) per question."""

    text: str  # everything up to and including the last answer (no EOS)
    answers: tuple[tuple[int, str], ...]
    keys: tuple[str, ...]  # keys of the records, in the order they appear
    filler_source: str  # "noise" or the doc ids the filler came from

    @property
    def prompt_len(self) -> int:
        """Bytes before the first answer's value (which follows a space)."""
        return self.answers[0][0] - 1


def _noise_filler(rng: random.Random, length: int) -> bytes:
    line = " ".join(rng.sample(NOISE_SENTENCES, rng.randint(3, 6))).encode()
    return b"\n".join([line] * (length // (len(line) + 1) + 1))[:length]


def _filler(rng: random.Random, pool: TextPool, length: int) -> tuple[bytes, str]:
    """`length` bytes of filler (train or eval text, or a repeated noise line) and where it came from."""
    if length <= 0:
        return b"", "none"
    if rng.random() < NOISE_FILLER_SHARE:
        return _noise_filler(rng, length), "noise"
    parts, sources, have = [], [], 0
    while have < length:  # a short document may end early: continue with another span
        data, doc_id = pool.span(rng, length - have)
        parts.append(data)
        sources.append(doc_id)
        have += len(data) + 1
    return b" ".join(parts)[:length], "+".join(sources)


_BOUNDARY = re.compile(r"(?<=[.!?;])\s+")


def _assemble(header: str, filler: str, needles: list[str], depths: list[float], joiner: str) -> str:
    """Header and filler with the needles inserted at the sentence boundaries nearest to their depths."""
    cuts = [0] + [m.start() for m in _BOUNDARY.finditer(filler)] + [len(filler)]
    pieces, last = [], 0
    for depth, needle in sorted(zip(depths, needles)):
        target = depth * len(filler)
        pos = max(min(cuts, key=lambda c: abs(c - target)), last)
        pieces += [filler[last:pos], needle]
        last = pos
    pieces.append(filler[last:])
    return header + joiner.join(p.strip() for p in pieces if p.strip())


def _question(rng: random.Random, key: str, name: str) -> tuple[str, str]:
    question, prefix = rng.choice(RECALL_QUESTIONS)
    if rng.random() < 0.3:  # the question names the value differently from its record
        name = rng.choice(VALUE_NAMES)
    return question.format(name=name, key=key), prefix.format(name=name, key=key)


def make_recall_doc(rng: random.Random, pool: TextPool, vocab: tuple[str, ...], target_bytes: int,
                    max_questions: int = MAX_QUESTIONS) -> RecallDoc | None:
    """A synthetic recall document of at most `target_bytes` UTF-8 bytes, filled up to about that
    size: 1-8 records in filler, then up to `max_questions` questions about distinct records, each
    followed by its answer (dense supervision: every answer is a training signal). None when not
    even one record, question and answer fit."""
    n_records = rng.choice(RECORD_COUNTS)
    kind = _weighted(rng, VALUE_KINDS)
    keys: list[str] = []
    while len(keys) < n_records:
        key = draw_key(rng, vocab)
        if key not in keys and not any(key in other or other in key for other in keys):
            keys.append(key)
    values = [draw_value(rng, kind, vocab) for _ in keys]
    shared_name = rng.choice(VALUE_NAMES)
    names = [shared_name if rng.random() < 0.7 else rng.choice(VALUE_NAMES) for _ in keys]
    needles = []
    for key, value, name in zip(keys, values, names):
        template = rng.choice(RECALL_NEEDLES)
        needles.append(template.format(name=name, Name=name[0].upper() + name[1:], key=key, value=value))
    asked = rng.sample(range(n_records), min(n_records, rng.randint(1, max_questions)))
    questions = [_question(rng, keys[i], names[i]) for i in asked]
    header = rng.choice(RECALL_HEADERS) + "\n" if rng.random() < 0.5 else ""
    joiner = rng.choice((" ", " ", "\n"))
    depths = [rng.random() for _ in needles]

    def tail_bytes() -> int:  # questions and answers: "\n" + question + prefix + " " + value + "." each
        return sum(len(q.encode()) + len(p.encode()) + len(values[i].encode()) + 3
                   for (q, p), i in zip(questions, asked))

    def fixed_size() -> int:  # bytes besides the filler (+2 per needle for the joiners around it)
        return len(header.encode()) + sum(len(n.encode()) + 2 for n in needles) + tail_bytes()

    # Small budgets: drop the header, then questions, then records not asked about.
    if fixed_size() + MIN_SYNTHETIC_FILLER > target_bytes:
        header = ""
    while fixed_size() + MIN_SYNTHETIC_FILLER > target_bytes and len(asked) > 1:
        asked.pop()
        questions.pop()
    while fixed_size() + MIN_SYNTHETIC_FILLER > target_bytes and len(needles) > len(asked):
        drop = next(i for i in range(len(needles)) if i not in asked)
        for column in (needles, keys, values, names, depths):
            del column[drop]
        asked = [i - (drop < i) for i in asked]
    if fixed_size() + MIN_SYNTHETIC_FILLER > target_bytes:
        return None
    raw, source = _filler(rng, pool, target_bytes - fixed_size())
    filler = raw.decode("utf-8", errors="ignore")
    while True:
        text, answers = _assemble(header, filler, needles, depths, joiner), []
        for (question, prefix), i in zip(questions, asked):
            text += "\n" + question + prefix + " "
            answers.append((len(text.encode()), values[i]))
            text += values[i] + "."
        excess = len(text.encode()) - target_bytes
        if excess <= 0:
            break
        filler = filler[: len(filler) - excess]  # rare: trim the filler
    return RecallDoc(text, tuple(answers), tuple(keys), source)


@dataclass(frozen=True)
class Segment:
    kind: str  # "natural" | "synthetic"
    source: str  # doc id(s) the text came from, or "noise"
    start: int  # token offset in the sequence
    end: int
    answers: tuple[tuple[int, int], ...] = ()  # (start, end) token offsets of the answers' values


class TrainStream:
    """Sequence i = a pure function of (seed, i, ctx, ramp). `ramp` > 0 is the number of sequences over
    which the distance curriculum opens up to the full context (0: no curriculum). `repeat` > 0 cycles
    over the first `repeat` sequences (smoke tests: the loss must fall on repeated data)."""

    def __init__(self, seed: int, ctx: int, synthetic_fraction: float = SYNTHETIC_FRACTION, repeat: int = 0,
                 ramp: int = 0, max_questions: int = MAX_QUESTIONS):
        if not 0.0 <= synthetic_fraction <= 1.0:
            raise ValueError(f"synthetic_fraction must be in [0, 1], got {synthetic_fraction}")
        self.seed, self.ctx, self.synthetic_fraction, self.repeat = seed, ctx, synthetic_fraction, repeat
        self.ramp, self.max_questions = ramp, max_questions
        self.pool = text_pool("train")
        self.vocab = key_vocabulary("train")

    def synthetic_cap(self, index: int) -> int:
        """The largest synthetic document (bytes) of sequence `index` under the distance curriculum."""
        full = self.ctx + 1
        if not self.ramp or index >= self.ramp:
            return full
        start = min(CURRICULUM_START, full)
        return start + (full - start) * index // self.ramp

    def sequence(self, index: int) -> tuple[list[int], list[Segment]]:
        if self.repeat:
            index %= self.repeat
        rng = random.Random(f"ccq-tiny-train|{self.seed}|{index}")
        length = self.ctx + 1
        cap = self.synthetic_cap(index)
        ids: list[int] = []
        segments: list[Segment] = []
        while len(ids) < length:
            room = length - len(ids)
            doc = None
            if rng.random() < self.synthetic_fraction and room > MIN_SYNTHETIC_DOC:
                # Synthetic docs always fit whole (answers and EOS included): never cut at the end.
                high = min(room, cap) - 1
                target = int(math.exp(rng.uniform(math.log(MIN_SYNTHETIC_DOC), math.log(max(high, MIN_SYNTHETIC_DOC)))))
                doc = make_recall_doc(rng, self.pool, self.vocab, max(MIN_SYNTHETIC_DOC, min(target, high)),
                                      self.max_questions)
            answers = ()
            if doc is not None:
                piece, kind, source = [*encode_bytes(doc.text), EOS_ID], "synthetic", doc.filler_source
                answers = tuple((len(ids) + at, len(ids) + at + len(value.encode())) for at, value in doc.answers)
            else:
                data, source = self.pool.span(rng, rng.randint(*NATURAL_SPAN))
                piece, kind = [*encode_bytes(data), EOS_ID], "natural"
            piece = piece[:room]
            segments.append(Segment(kind, source, len(ids), len(ids) + len(piece), answers))
            ids.extend(piece)
        return ids, segments

    def batch(self, step: int, batch_size: int) -> torch.Tensor:
        rows = [self.sequence(step * batch_size + i)[0] for i in range(batch_size)]
        return torch.tensor(rows, dtype=torch.long)


def heldout_windows(ctx: int, n_windows: int) -> tuple[torch.Tensor, list[str]]:
    """n_windows windows of ctx + 1 byte tokens from the eval split: split as evenly as possible
    over the three corpora, spread evenly over each corpus's documents long enough to hold one,
    starting at a word start. Independent of any seed; identical for every model."""
    pool = text_pool("eval")
    rows, where = [], []
    per_corpus = [n_windows // len(CORPUS_NAMES) + (i < n_windows % len(CORPUS_NAMES))
                  for i in range(len(CORPUS_NAMES))]
    for name, count in zip(CORPUS_NAMES, per_corpus):
        docs = [(doc_id, data) for doc_id, data in zip(pool.doc_ids, pool.docs)
                if doc_id.startswith(name + "/") and len(data) >= ctx + 64 + 1]
        if count and not docs:
            raise ValueError(f"no eval document of {name} is long enough for a {ctx}-byte window")
        sizes = [len(data) - ctx - 64 for _, data in docs]  # valid start offsets per doc
        total = sum(sizes)
        cumulative = [0]
        for size in sizes:
            cumulative.append(cumulative[-1] + size)
        for k in range(count):
            target = int((k + 0.5) * total / count)
            j = min(bisect.bisect_right(cumulative, target) - 1, len(docs) - 1)
            doc_id, data = docs[j]
            start = target - cumulative[j]
            space = data.find(b" ", start, start + 64)
            start = space + 1 if space >= 0 else start
            window = data[start : start + ctx + 1]
            rows.append(encode_bytes(window))
            where.append(f"{doc_id}@{start}")
    return torch.tensor(rows, dtype=torch.long), where


def heldout_recall_docs(ctx: int, n_docs: int) -> list[RecallDoc]:
    """Synthetic recall documents of about ctx bytes with eval-split filler, fixed (seed-free)."""
    pool, vocab = text_pool("eval"), key_vocabulary("train")
    docs = []
    for i in range(n_docs):
        rng = random.Random(f"ccq-tiny-heldout-recall|{ctx}|{i}")
        doc = make_recall_doc(rng, pool, vocab, ctx)
        if doc is None:
            raise ValueError(f"ctx={ctx} is too short for a recall document (need about {MIN_SYNTHETIC_DOC} bytes)")
        docs.append(doc)
    return docs
