"""Training and held-out data for the embedded tiny checkpoints (used by scripts/train_tiny.py).

Everything here is a pure function of (seed, index): sequence i of the training stream is built
by its own random.Random, so the data order does not depend on batch size, process or hardware.

Training stream: documents packed into sequences of ctx + 1 byte tokens (ctx inputs, ctx
targets). Each sequence starts at a document start and is filled by drawing documents until it is
full (the last one is cut at the sequence end, documents end with EOS):
- natural English: a contiguous span of a train-split document of the embedded corpora
  (sotu, kjv, austen; every train byte equally likely as a start, snapped to a word start);
- synthetic in-context recall: key-value records hidden in filler, one of the keys asked for at
  the end, then its value. The wording is our own and deliberately differs from the RULER
  S-NIAH templates (no "special magic", no "mentioned in the provided text"), so S-NIAH measures
  transfer of the recall skill, not memorised phrasing. Filler is train-split text (most docs) or
  a repeated line of plain sentences written for this script.

Held-out data comes from the eval split only, is independent of the training seed, and is the
same for every model: ctx + 1 byte windows spread evenly over each corpus, and recall documents
built the same way as the synthetic training documents but with eval-split filler.

Tokens are ByT5's byte ids: byte b -> b + 3 (pad 0, eos 1, unk 2), no BOS.
"""

from __future__ import annotations

import bisect
import random
import re
import uuid
from collections import Counter
from dataclasses import dataclass
from functools import cache

import torch

from ccq_eval.harness.corpora import load_corpus

CORPUS_NAMES = ("sotu", "kjv", "austen")
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
BYTE_OFFSET = 3  # ByT5: token id = byte value + 3
SYNTHETIC_FRACTION = 0.42  # probability that a drawn document is synthetic: about a third of the tokens at ctx 2048
NATURAL_SPAN = (256, 4096)  # bytes of one natural document before it is cut at the sequence end
MIN_SYNTHETIC_FILLER = 48  # a synthetic doc needs at least this much filler
MIN_SYNTHETIC_DOC = 256  # bytes; smaller spaces at a sequence end get natural text

# Our own wording (not RULER's). Each needle and each question picks one template at random.
RECALL_HEADERS = (
    "Read the passage below and keep track of every value it records; one of them will be asked for.",
    "The following text contains a few labelled entries. Remember them.",
    "Some entries are scattered through this passage. A question about one of them comes at the end.",
)
RECALL_NEEDLES = (
    "Record: the code word for {key} equals {value}.",
    "Note for later: {key} is paired with {value}.",
    "Ledger entry, {key}: {value}.",
    "Keep this in mind: the value filed under {key} is {value}.",
    "(Reference {key} carries the value {value}.)",
)
# (prompt, answer); the answer is what the model learns to produce after the prompt.
RECALL_QUESTIONS = (
    ("Question: which value was given for {key}? Answer:", " {value}"),
    ("Q: what was {key} paired with earlier in the text? A:", " {value}"),
    ("Looking back over the text, the value filed under {key} was", " {value}."),
    ("Recall the entry for {key}. It was", " {value}."),
)
# Repetitive filler lines (written for this script) for a share of the synthetic documents.
NOISE_LINES = (
    "The river runs to the sea. The hills stand quiet. The lamp is lit. On we walk. Home before dark.",
    "A bird sings on the wall. The bread is warm. The door is open. So it goes. Round and round again.",
    "The clock ticks on the shelf. Rain taps the glass. The fire is low. Day after day. Slowly and surely.",
)
NOISE_FILLER_SHARE = 0.2
VALUE_KINDS = (("number7", 0.4), ("number", 0.2), ("uuid", 0.25), ("word", 0.15))
KEY_FORMS = (("pair", 0.6), ("word", 0.2), ("word-number", 0.2))
# RULER S-NIAH phrases that must never appear in training text (checked in tests).
FORBIDDEN_PHRASES = ("special magic", "mentioned in the provided text", "One of the special")


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
def key_vocabulary(split: str = "train") -> tuple[str, ...]:
    """Lower-case words (4-10 letters, seen at least 5 times) of a split, for keys and word values."""
    counts: Counter[str] = Counter()
    for doc in text_pool(split).docs:
        counts.update(re.findall(rb"\b[a-z]{4,10}\b", doc))
    return tuple(sorted(w.decode() for w, c in counts.items() if c >= 5))


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
    text: str  # everything up to and including the answer (no EOS)
    prompt_len: int  # bytes of text before the answer
    key: str
    value: str
    filler_source: str  # "noise" or the doc ids the filler came from


def _filler(rng: random.Random, pool: TextPool, length: int) -> tuple[bytes, str]:
    """`length` bytes of filler (train or eval text, or a repeated noise line) and where it came from."""
    if length <= 0:
        return b"", "none"
    if rng.random() < NOISE_FILLER_SHARE:
        line = rng.choice(NOISE_LINES).encode()
        return b"\n".join([line] * (length // (len(line) + 1) + 1))[:length], "noise"
    parts, sources, have = [], [], 0
    while have < length:  # a short document may end early: continue with another span
        data, doc_id = pool.span(rng, length - have)
        parts.append(data)
        sources.append(doc_id)
        have += len(data) + 1
    return b" ".join(parts)[:length], "+".join(sources)


_BOUNDARY = re.compile(r"(?<=[.!?;])\s+")


def _assemble(header: str, filler: str, needles: list[str], depths: list[float], question: str) -> str:
    """The prompt: needles inserted at the sentence boundaries nearest to their depths."""
    cuts = [0] + [m.start() for m in _BOUNDARY.finditer(filler)] + [len(filler)]
    pieces, last = [], 0
    for depth, needle in sorted(zip(depths, needles)):
        target = depth * len(filler)
        pos = min(cuts, key=lambda c: abs(c - target))
        pos = max(pos, last)
        pieces += [filler[last:pos], needle]
        last = pos
    pieces.append(filler[last:])
    body = " ".join(p.strip() for p in pieces if p.strip())
    return f"{header}{body}\n{question}"


def make_recall_doc(rng: random.Random, pool: TextPool, vocab: tuple[str, ...], target_bytes: int) -> RecallDoc | None:
    """A synthetic recall document of at most `target_bytes` UTF-8 bytes, filled up to about that
    size; None when not even one record, question and answer fit."""
    n_keys = rng.choice((1, 1, 2, 3, 4))
    kind = _weighted(rng, VALUE_KINDS)
    keys: list[str] = []
    while len(keys) < n_keys:
        key = draw_key(rng, vocab)
        if key not in keys:
            keys.append(key)
    values = [draw_value(rng, kind, vocab) for _ in keys]
    needles = [rng.choice(RECALL_NEEDLES).format(key=k, value=v) for k, v in zip(keys, values)]
    asked = rng.randrange(n_keys)
    question_template, answer_template = rng.choice(RECALL_QUESTIONS)
    question = question_template.format(key=keys[asked])
    answer = answer_template.format(value=values[asked])
    header = rng.choice(RECALL_HEADERS) + "\n" if rng.random() < 0.5 else ""
    depths = [rng.random() for _ in needles]

    def fixed_size() -> int:  # bytes besides the filler (+2 per needle for joining spaces)
        return (len(header.encode()) + sum(len(n.encode()) + 2 for n in needles)
                + len(question.encode()) + 1 + len(answer.encode()))

    # Small budgets: drop the header, then records other than the asked one.
    if fixed_size() + MIN_SYNTHETIC_FILLER > target_bytes:
        header = ""
    while fixed_size() + MIN_SYNTHETIC_FILLER > target_bytes and len(needles) > 1:
        drop = next(i for i in range(len(needles)) if i != asked)
        del needles[drop], keys[drop], values[drop], depths[drop]
        asked -= drop < asked
    if fixed_size() + MIN_SYNTHETIC_FILLER > target_bytes:
        return None
    raw, source = _filler(rng, pool, target_bytes - fixed_size())
    filler = raw.decode("utf-8", errors="ignore")
    prompt = _assemble(header, filler, needles, depths, question)
    while len(prompt.encode()) + len(answer.encode()) > target_bytes:  # rare: trim the filler
        filler = filler[: len(filler) - (len(prompt.encode()) + len(answer.encode()) - target_bytes)]
        prompt = _assemble(header, filler, needles, depths, question)
    return RecallDoc(prompt + answer, len(prompt.encode()), keys[asked], values[asked], source)


@dataclass(frozen=True)
class Segment:
    kind: str  # "natural" | "synthetic"
    source: str  # doc id(s) the text came from, or "noise"
    start: int  # token offset in the sequence
    end: int


class TrainStream:
    """Sequence i = a pure function of (seed, i, ctx). `repeat` > 0 cycles over the first `repeat`
    sequences (smoke tests: the loss must fall on repeated data)."""

    def __init__(self, seed: int, ctx: int, synthetic_fraction: float = SYNTHETIC_FRACTION, repeat: int = 0):
        if not 0.0 <= synthetic_fraction <= 1.0:
            raise ValueError(f"synthetic_fraction must be in [0, 1], got {synthetic_fraction}")
        self.seed, self.ctx, self.synthetic_fraction, self.repeat = seed, ctx, synthetic_fraction, repeat
        self.pool = text_pool("train")
        self.vocab = key_vocabulary("train")

    def sequence(self, index: int) -> tuple[list[int], list[Segment]]:
        if self.repeat:
            index %= self.repeat
        rng = random.Random(f"ccq-tiny-train|{self.seed}|{index}")
        length = self.ctx + 1
        ids: list[int] = []
        segments: list[Segment] = []
        while len(ids) < length:
            room = length - len(ids)
            doc = None
            if rng.random() < self.synthetic_fraction and room > MIN_SYNTHETIC_DOC:
                # Synthetic docs always fit whole (answer and EOS included): never cut at the end.
                target = rng.randint(MIN_SYNTHETIC_DOC, min(room, self.ctx + 1) - 1)
                doc = make_recall_doc(rng, self.pool, self.vocab, target)
            if doc is not None:
                piece, kind, source = encode_bytes(doc.text) + [EOS_ID], "synthetic", doc.filler_source
            else:
                data, source = self.pool.span(rng, rng.randint(*NATURAL_SPAN))
                piece, kind = encode_bytes(data) + [EOS_ID], "natural"
            piece = piece[:room]
            segments.append(Segment(kind, source, len(ids), len(ids) + len(piece)))
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
