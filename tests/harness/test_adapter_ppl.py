"""The perplexity tasks (tasks/ppl) end to end through lm_eval.simple_evaluate with a tiny model,
checked against perplexities computed directly from the model's logits."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from adapter_support import byte_tokenizer, full_token_nll, one_torch_thread, ppl_utils, tiny_model  # noqa: F401
from lm_eval import simple_evaluate

from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.harness.task_registry import make_task_manager

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory) -> list[str]:
    """Three documents of 250, 520 and 900 bytes (byte tokens)."""
    rng = random.Random(0)
    folder = tmp_path_factory.mktemp("ppl_corpus")
    paths = []
    for index, size in enumerate((250, 520, 900)):
        text = ""
        while len(text) < size:
            text += rng.choice(WORDS) + " "
        path = folder / f"doc{index}.txt"
        path.write_text(text[:size], encoding="utf-8")
        paths.append(str(path))
    return paths


def _run(model, tokenizer, task: str, metadata: dict) -> dict:
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, chunk_size=45, batch_size=2)
    return simple_evaluate(model=lm, tasks=[task], task_manager=make_task_manager(metadata), bootstrap_iters=0,
                           log_samples=True)


def test_bucket_results_partition_the_block() -> None:
    utils = ppl_utils()
    assert utils.bucket_ranges(20480, 2048)[-1] == (18432, 20480) and len(utils.bucket_ranges(20480, 2048)) == 10
    token_nll = [0.1 * (i % 7) for i in range(99)]  # a 100-token block: 99 predictions
    out = utils.bucket_results(token_nll, block_length=100, bucket_size=30)
    assert [k for k in out if k.startswith("tokens@")] == ["tokens@0-30", "tokens@30-60", "tokens@60-90",
                                                          "tokens@90-100"]
    assert [out[f"tokens@{r}"] for r in ("0-30", "30-60", "60-90", "90-100")] == [30, 30, 30, 9]
    assert out["tokens"] == 99 and out["ppl"] == (pytest.approx(sum(token_nll)), 99)
    assert math.fsum(out[k] for k in out if k.startswith("nll@")) == pytest.approx(out["nll"], abs=1e-12)
    assert utils.perplexity_of_pairs([(2.0, 4), (6.0, 4)]) == pytest.approx(math.exp(1.0))


def test_bucket_task_matches_direct_logits(corpus_files) -> None:
    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer)
    block, bucket = 160, 40
    metadata = {"tokenizer": "byt5", "data_files": ",".join(corpus_files), "lengths": [block],
                "bucket_size": bucket}
    out = _run(model, tokenizer, "ccq_ppl_buckets", metadata)
    result = out["results"]["ccq_ppl_buckets"]
    samples = out["samples"]["ccq_ppl_buckets"]

    # The blocks are consecutive slices of the token stream (each stripped document followed by EOS).
    stream = []
    for path in corpus_files:
        stream += tokenizer.encode(Path(path).read_text(encoding="utf-8").strip(), add_special_tokens=False)
        stream.append(tokenizer.eos_token_id)
    n_blocks = len(stream) // block
    assert len(samples) == n_blocks == 10
    by_index = sorted(samples, key=lambda s: s["doc"]["block_index"])
    for index, sample in enumerate(by_index):
        assert sample["doc"]["roundtrip_exact"]
        encoded = tokenizer.encode(sample["doc"]["text"], add_special_tokens=False)
        assert encoded == stream[index * block:(index + 1) * block]

    # Direct: one full forward per block, no BOS (ByT5 has none): 159 predictions per block.
    per_token = torch.stack([full_token_nll(model, stream[i * block:(i + 1) * block]) for i in range(n_blocks)])
    assert result["tokens,none"] == n_blocks * (block - 1)
    assert result["ppl,none"] == pytest.approx(math.exp(float(per_token.mean())), rel=1e-9)
    ranges = [(0, 40), (40, 80), (80, 120), (120, 160)]
    log_weighted = 0.0
    for start, end in ranges:
        expected = per_token[:, start:min(end, block - 1)]
        assert result[f"tokens@{start}-{end},none"] == expected.numel()
        assert result[f"ppl@{start}-{end},none"] == pytest.approx(math.exp(float(expected.mean())), rel=1e-9)
        assert result[f"nll@{start}-{end},none"] == pytest.approx(float(expected.sum()), rel=1e-9)
        log_weighted += result[f"tokens@{start}-{end},none"] * math.log(result[f"ppl@{start}-{end},none"])
    # token-weighted combination of the buckets gives the overall value
    assert math.exp(log_weighted / result["tokens,none"]) == pytest.approx(result["ppl,none"], rel=1e-12)
    # per-sample logs keep each block's (nll_sum, n) per bucket
    assert by_index[0]["ppl@0-40"][1] == 40 and by_index[0]["ppl@120-160"][1] == 39


def test_sweep_task_matches_direct_logits_with_bos(corpus_files) -> None:
    tokenizer = byte_tokenizer(with_bos=True)
    model = tiny_model(tokenizer)
    lengths = [100, 300, 600]
    metadata = {"tokenizer": tokenizer, "data_files": corpus_files, "lengths": lengths}
    out = _run(model, tokenizer, "ccq_ppl_sweep", metadata)
    result = out["results"]["ccq_ppl_sweep"]

    documents = [tokenizer.encode(Path(p).read_text(encoding="utf-8").strip(), add_special_tokens=False)
                 for p in corpus_files]
    for length in lengths:
        # the model sees exactly L tokens: BOS + the first L - 1 text tokens, all of them scored
        kept = [ids[:length - 1] for ids in documents if len(ids) >= length - 1]
        nll = torch.cat([full_token_nll(model, [tokenizer.bos_token_id, *ids]) for ids in kept])
        assert result[f"docs@{length},none"] == len(kept)
        assert result[f"tokens@{length},none"] == len(kept) * (length - 1) == nll.numel()
        assert result[f"ppl@{length},none"] == pytest.approx(math.exp(float(nll.mean())), rel=1e-9)
        per_doc = nll.view(len(kept), length - 1).mean(dim=1).exp()  # YaRN's mean of document perplexities
        assert result[f"doc_ppl@{length},none"] == pytest.approx(float(per_doc.mean()), rel=1e-9)
    assert [result[f"docs@{n},none"] for n in lengths] == [3, 2, 1]


def test_ppl_tasks_need_a_tokenizer_and_documents(corpus_files) -> None:
    utils = ppl_utils()
    with pytest.raises(ValueError, match="tokenizer"):
        utils.sweep_documents(data_files=corpus_files[0], lengths=[10])
    with pytest.raises(ValueError, match="no document reaches"):
        utils.sweep_documents(tokenizer="byt5", data_files=corpus_files[0], lengths=[5000])
    with pytest.raises(ValueError, match="lengths"):
        utils.parse_lengths("4k,abc")
    assert utils.parse_lengths("1k,2048") == [1024, 2048]
