"""scripts/train_tiny.py: CPU smoke runs, determinism, the saved folders, and the training data."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import tiny_data  # noqa: E402  (from scripts/, on sys.path from here on)
import train_settings  # noqa: E402
import train_tiny  # noqa: E402

from ccq_eval.data.corpora import load_corpus  # noqa: E402
from ccq_eval.model.families import family_of  # noqa: E402
from ccq_eval.model.loading import load_model  # noqa: E402

# Small enough for a loaded 2-core CI machine; 320 tokens leave room for synthetic recall docs.
SMOKE_ARGS = ["--smoke", "--steps", "6", "--batch-size", "1", "--context", "320", "--repeat", "1",
              "--eval-windows", "2", "--recall-docs", "1", "--seed", "3"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke_a")
    results = train_tiny.main([*SMOKE_ARGS, "--models", "tiny-gla,tiny-gla-ccq,tiny-transformer", "--out", str(out),
                               "--register"])
    return out, results


@pytest.mark.parametrize("name, model_type, ccq", [("tiny-gla", "gla", False), ("tiny-gla-ccq", "ccq_gla", True),
                                                   ("tiny-transformer", "llama", False)])
def test_smoke_folder_is_a_complete_loadable_checkpoint(smoke_run, name, model_type, ccq):
    out, _ = smoke_run
    folder = out / name
    for file in ("config.json", "model.safetensors", "tokenizer_config.json", "README.md", "train_log.json"):
        assert (folder / file).is_file(), f"{file} missing from {folder}"
    assert not list(folder.glob("*.bin")), "weights must be safetensors only"
    assert not [p for p in out.iterdir() if p.name.startswith((".tmp-", ".old-"))], "temporary folder left behind"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == model_type
    if ccq:
        assert config["ccq"] is True
    else:  # baselines are plain fla checkpoints
        assert not any(key.startswith("ccq") for key in config)
    assert (folder / "model.safetensors").stat().st_size <= train_tiny.MAX_CHECKPOINT_BYTES

    model, tokenizer = load_model(str(folder))
    assert getattr(model.config, "ccq", False) is ccq
    assert next(model.parameters()).dtype == torch.float32
    text = "Record: the code word for quiet-harbor equals 1234567."
    assert tokenizer(text, add_special_tokens=False).input_ids == tiny_data.encode_bytes(text)
    assert tokenizer.decode(tiny_data.encode_bytes(text)) == text

    log = json.loads((folder / "train_log.json").read_text())
    losses = log["train"]["step_losses"]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    # Repeated data: the loss must fall clearly within six steps.
    assert losses[-1] < losses[0] - 0.5, losses
    assert log["train"]["tokens_seen"] == 6 * 1 * 320

    # The reported held-out loss is what the saved weights give on the eval-split windows.
    windows, _ = tiny_data.heldout_windows(320, 2)
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1], use_cache=False).logits.float()
    nll = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    assert nll == pytest.approx(log["heldout"]["heldout_nll_per_byte"], rel=1e-4)
    assert log["heldout"]["heldout_perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)
    # Trained, even this briefly, it beats a uniform distribution over its 384 tokens (initial ~ln 384).
    assert nll < math.log(384) - 0.3

    card = (folder / "README.md").read_text()
    for needle in ("tokens seen: 1,920", "Steps: 6", "batch: 1", "Final train loss", "Held-out loss",
                   "perplexity", "Wall time", "Hardware", "torch", "scripts/train_tiny.py --smoke",
                   "demonstration model"):
        assert needle in card, f"model card lacks {needle!r}"

    entry = json.loads((out / "registry.json").read_text())[name]
    assert entry["path"] == name and entry["default"] is True and entry["description"]


def test_baseline_is_a_plain_fla_checkpoint_with_the_same_logits(smoke_run):
    from fla.models import GLAForCausalLM

    from ccq_eval.model.fla_cpu import use_torch_backend

    out, _ = smoke_run
    ours, _ = load_model(str(out / "tiny-gla"))
    # fla's own class, given the CPU backend (fla's triton kernels need a GPU)
    plain = use_torch_backend(GLAForCausalLM.from_pretrained(out / "tiny-gla", dtype=torch.float32)).eval()
    ids = torch.tensor([tiny_data.encode_bytes("Note for later: the lamp is lit.")])
    with torch.no_grad():
        assert torch.equal(ours(ids, use_cache=False).logits, plain(ids, use_cache=False).logits)


def test_smoke_is_deterministic_for_a_seed(smoke_run, tmp_path):
    out, first = smoke_run
    again = train_tiny.main([*SMOKE_ARGS, "--models", "tiny-gla-ccq", "--out", str(tmp_path)])
    a, b = first["tiny-gla-ccq"], again["tiny-gla-ccq"]
    assert a["train"]["step_losses"] == b["train"]["step_losses"]
    assert a["heldout"]["heldout_nll_per_byte"] == b["heldout"]["heldout_nll_per_byte"]
    assert (out / "tiny-gla-ccq" / "model.safetensors").read_bytes() == \
        (tmp_path / "tiny-gla-ccq" / "model.safetensors").read_bytes()
    assert not (tmp_path / "registry.json").exists(), "--smoke must not register unless asked"


def test_twins_share_initial_backbone_and_seed_matters():
    specs = train_tiny.MODEL_SPECS
    for base, ccq in (("tiny-gla", "tiny-gla-ccq"), ("tiny-gdn", "tiny-gdn-ccq")):
        plain = dict(train_tiny.build_model(specs[base], 320, smoke=True, seed=5).named_parameters())
        with_ccq = dict(train_tiny.build_model(specs[ccq], 320, smoke=True, seed=5).named_parameters())
        other = dict(train_tiny.build_model(specs[base], 320, smoke=True, seed=6).named_parameters())
        # The baseline has no CCQ parameters; the CCQ twin adds only its gate.
        assert set(with_ccq) - set(plain) == {n for n in with_ccq if ".ccq_gate_" in n} != set()
        assert set(plain) <= set(with_ccq)
        for name, param in plain.items():
            assert torch.equal(param, with_ccq[name]), name
        assert not torch.equal(plain["model.embeddings.weight"], other["model.embeddings.weight"])


def test_full_shapes_fit_the_checkpoint_limit():
    # The real shapes (not smoke): bf16 weights of every model stay under 10 MB; twins have equal
    # backbone sizes.
    sizes = {}
    for name, spec in train_tiny.MODEL_SPECS.items():
        model = train_tiny.build_model(spec, train_settings.CONTEXT, smoke=False, seed=0)
        sizes[name] = train_tiny.count_parameters(model, spec.ccq)
        assert sizes[name] * 2 < train_tiny.MAX_CHECKPOINT_BYTES - 100_000, (name, sizes[name])
        # Mamba2's blocks have no MLP: twice the layers for about the same size
        assert model.config.hidden_size == 256 and model.config.num_hidden_layers == (8 if spec.family == "mamba2"
                                                                                      else 4)
    # CCQ adds only its gate per head and layer: a_h (head_k numbers) and b_h.
    assert sizes["tiny-gla-ccq"] - sizes["tiny-gla"] == 4 * 2 * (64 + 1)  # GLA head_k = 256 * 0.5 / 2
    assert sizes["tiny-gdn-ccq"] - sizes["tiny-gdn"] == 4 * 2 * (64 + 1)  # GDN head_dim 64


def ruler_phrases() -> list[str]:
    """RULER's S-NIAH wording as the task builds it: the fixed pieces (three words or more) of its
    template, answer prefix and needle, and the sentences of its noise haystack."""
    import re

    from ccq_eval.tasks.s_niah import utils as s_niah

    pieces = []
    for template in (s_niah.TEMPLATE, s_niah.ANSWER_PREFIX, s_niah.NEEDLE, s_niah.NOISE_LINE):
        for part in re.split(r"\{[a-z]+\}|\n|(?<=[.?])\s", template):
            if len(part.split()) >= 3:
                pieces.append(part.strip())
    return pieces


def test_forbidden_phrases_cover_ruler_wording():
    pieces = ruler_phrases()
    assert len(pieces) >= 8 and any("special magic" in p for p in pieces)
    for piece in pieces:
        assert any(phrase.lower() in piece.lower() or piece.lower() in phrase.lower()
                   for phrase in tiny_data.FORBIDDEN_PHRASES), piece


def test_training_stream_is_deterministic_mixed_and_train_only():
    stream = tiny_data.TrainStream(seed=0, ctx=2048)
    train_ids = {f"{name}/{doc.id}" for name in tiny_data.CORPUS_NAMES for doc in load_corpus(name, "train")}
    eval_ids = {f"{name}/{doc.id}" for name in tiny_data.CORPUS_NAMES for doc in load_corpus(name, "eval")}
    forbidden = [p.lower() for p in (*tiny_data.FORBIDDEN_PHRASES, *ruler_phrases())]
    synthetic = total = answers = 0
    for index in range(48):
        ids, segments = stream.sequence(index)
        assert len(ids) == 2049
        assert (ids, segments) == tiny_data.TrainStream(seed=0, ctx=2048).sequence(index)
        text = tiny_data.decode_bytes(ids).lower()
        for phrase in forbidden:
            assert phrase not in text, f"RULER wording {phrase!r} in training sequence {index}"
        for seg in segments:
            sources = [] if seg.source in ("noise", "none") else seg.source.split("+")
            assert all(s in train_ids and s not in eval_ids for s in sources), seg
            if seg.kind == "synthetic":
                synthetic += seg.end - seg.start
                assert ids[seg.end - 1] == tiny_data.EOS_ID  # a recall doc is never cut before its answers
                assert seg.answers and all(seg.start < a < b < seg.end for a, b in seg.answers)
                for begin, end in seg.answers:  # each answer is a value written in a record before it
                    value = tiny_data.decode_bytes(ids[begin:end])
                    assert value in tiny_data.decode_bytes(ids[seg.start:begin]), (index, value)
                    answers += 1
            else:
                assert not seg.answers
        total += len(ids)
    assert 0.35 <= synthetic / total <= 0.65, synthetic / total
    assert answers >= 48  # several questions per sequence
    assert stream.sequence(0) != tiny_data.TrainStream(seed=1, ctx=2048).sequence(0)


def test_curriculum_grows_synthetic_documents_to_the_context():
    stream = tiny_data.TrainStream(seed=0, ctx=2048, synthetic_fraction=1.0, ramp=1000)
    assert stream.synthetic_cap(0) == tiny_data.CURRICULUM_START
    assert stream.synthetic_cap(500) < stream.synthetic_cap(999) < stream.synthetic_cap(1000) == 2049
    for index in (0, 1, 2, 3):  # early: every synthetic document within the cap
        _, segments = stream.sequence(index)
        assert all(s.end - s.start <= stream.synthetic_cap(index) for s in segments if s.kind == "synthetic")
    late = [s.end - s.start for i in range(2000, 2040) for s in stream.sequence(i)[1] if s.kind == "synthetic"]
    assert max(late) > 1024  # past the ramp, long distances are trained


def test_recall_documents_answer_every_question_from_its_record():
    import random

    pool, vocab = tiny_data.text_pool("train"), tiny_data.key_vocabulary("train")
    held_out = tiny_data.s_niah_key_words()
    rng = random.Random(0)
    questions = 0
    for _ in range(80):
        target = rng.randint(256, 2048)
        doc = tiny_data.make_recall_doc(rng, pool, vocab, target, max_questions=6)
        assert doc is not None and len(doc.text.encode()) <= target
        raw = doc.text.encode()
        first_question = raw.rfind(b"\n", 0, doc.prompt_len)
        body = raw[:first_question].decode()
        assert doc.prompt_len == doc.answers[0][0] - 1
        for begin, value in doc.answers:
            assert raw[begin : begin + len(value.encode())].decode() == value and raw[begin - 1 : begin] == b" "
            line = raw[raw.rfind(b"\n", 0, begin) + 1 : begin].decode()
            asked = [k for k in doc.keys if k in line]
            assert len(asked) == 1, line  # the question names one key ...
            # ... whose record, earlier in the text, gives the value within a few words of the key
            starts = [i for i in range(len(body)) if body.startswith(value, i)]
            assert any(0 <= i - body.rfind(asked[0], 0, i) <= 80 for i in starts), (asked[0], value)
            questions += 1
        for key in doc.keys:  # no key is built from S-NIAH's key words
            assert not set(key.split("-")) & held_out, key
    assert questions > 80  # several questions per document on average


def test_templates_use_our_own_wording():
    texts = (*tiny_data.RECALL_NEEDLES, *(q + p for q, p in tiny_data.RECALL_QUESTIONS), *tiny_data.VALUE_NAMES,
             *tiny_data.RECALL_HEADERS, *tiny_data.NOISE_SENTENCES)
    for text in texts:
        for phrase in (*tiny_data.FORBIDDEN_PHRASES, *ruler_phrases()):
            assert phrase.lower() not in text.lower(), (phrase, text)
    assert tiny_data.s_niah_key_words() and not set(tiny_data.key_vocabulary("train")) & tiny_data.s_niah_key_words()


def test_answer_mask_marks_the_values_and_weighs_the_loss():
    stream = tiny_data.TrainStream(seed=0, ctx=512, synthetic_fraction=1.0)
    tokens, answers, synthetic = train_tiny.BatchDataset(stream, steps=1, batch_size=2)[0]
    assert tokens.shape == answers.shape == (2, 513) and answers.any() and synthetic > 0
    for row in range(2):
        _, segments = stream.sequence(row)
        expected = torch.zeros(513, dtype=torch.bool)
        for seg in segments:
            for begin, end in seg.answers:
                expected[begin:end] = True
        assert torch.equal(answers[row], expected)
    model = train_tiny.build_model(train_tiny.MODEL_SPECS["tiny-gla"], 512, smoke=True, seed=0)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits.float()
        nll = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        weights = 1 + 7 * answers[:, 1:].flatten().float()
        expected = (nll * weights).sum() / weights.sum()
        assert train_tiny.lm_loss(model, tokens, answers, 8.0).item() == pytest.approx(expected.item(), rel=1e-5)
        assert train_tiny.lm_loss(model, tokens, answers, 1.0).item() == pytest.approx(nll.mean().item(), rel=1e-5)


def test_continued_twins_start_from_the_baseline_weights(smoke_run):
    out, results = smoke_run
    settings = train_tiny.TrainSettings(**{**results["tiny-gla"]["settings"], "init_from": str(out)})
    plain = dict(train_tiny.initial_model(train_tiny.MODEL_SPECS["tiny-gla"], settings).named_parameters())
    with_ccq = dict(train_tiny.initial_model(train_tiny.MODEL_SPECS["tiny-gla-ccq"], settings).named_parameters())
    saved, _ = load_model(str(out / "tiny-gla"))
    assert set(with_ccq) - set(plain) == {n for n in with_ccq if ".ccq_gate_" in n} != set()
    for name, param in saved.named_parameters():
        assert torch.equal(plain[name], param) and torch.equal(with_ccq[name], param), name
    with pytest.raises(SystemExit, match="tiny-gdn"):
        train_tiny.initial_model(train_tiny.MODEL_SPECS["tiny-gdn"], settings)


def test_heldout_data_comes_from_the_eval_split():
    windows, where = tiny_data.heldout_windows(2048, 32)
    assert windows.shape == (32, 2049) and len(set(where)) == 32
    assert {w.split("/")[0] for w in where} == set(tiny_data.CORPUS_NAMES)
    eval_text = {f"{name}/{doc.id}": doc.text for name in tiny_data.CORPUS_NAMES for doc in load_corpus(name, "eval")}
    for row, origin in zip(windows.tolist(), where):
        doc_id = origin.rsplit("@", 1)[0]
        assert bytes(i - 3 for i in row) in eval_text[doc_id].encode()
    docs = tiny_data.heldout_recall_docs(2048, 4)
    assert docs == tiny_data.heldout_recall_docs(2048, 4)
    assert all(s in eval_text for d in docs if d.filler_source != "noise" for s in d.filler_source.split("+"))


def test_bad_model_name_is_refused_with_the_choices():
    with pytest.raises(SystemExit, match="tiny-gla-ccq"):
        train_tiny.parse_models("tiny-gla,tiny-foo")


@pytest.mark.slow
def test_smoke_new_family_baselines_train_save_and_load(tmp_path):
    """The baselines of other families (fla's own classes, no twin): trained a few steps on the CPU through
    fla_cpu's ops (backward included), saved as plain fla checkpoints, loaded by ccq-eval's loader."""
    names = "tiny-deltanet,tiny-kda,tiny-mamba2,tiny-precond-gdn"
    results = train_tiny.main([*SMOKE_ARGS, "--models", names, "--out", str(tmp_path)])
    for name, model_type in zip(names.split(","), ("delta_net", "kda", "mamba2", "precond_gated_deltanet")):
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["model_type"] == model_type and not any(key.startswith("ccq") for key in config)
        assert math.isfinite(results[name]["heldout"]["heldout_perplexity"])
        model, _ = load_model(str(tmp_path / name))
        assert type(model).__name__ == family_of(model_type).model_class.__name__  # fla's own class
        assert "fla's own model" in (tmp_path / name / "README.md").read_text()
    # A later stage continues from the saved folder (--init-from) through the same op dispatch: on the CPU
    # fla's own kernels would fail, so a finished stage shows the continued model got it too.
    continued = train_tiny.main([*SMOKE_ARGS, "--models", "tiny-precond-gdn", "--init-from", str(tmp_path),
                                 "--out", str(tmp_path / "stage2")])
    assert math.isfinite(continued["tiny-precond-gdn"]["heldout"]["heldout_perplexity"])


def test_smoke_gated_deltanet_twins(tmp_path):
    results = train_tiny.main([*SMOKE_ARGS, "--models", "tiny-gdn,tiny-gdn-ccq", "--out", str(tmp_path)])
    for name, model_type in (("tiny-gdn", "gated_deltanet"), ("tiny-gdn-ccq", "ccq_gated_deltanet")):
        losses = results[name]["train"]["step_losses"]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5
        assert json.loads((tmp_path / name / "config.json").read_text())["model_type"] == model_type
        model, _ = load_model(str(tmp_path / name))
        assert model.config.ccq is name.endswith("-ccq")


def test_failed_save_leaves_the_previous_checkpoint_untouched(smoke_run, tmp_path, monkeypatch):
    import shutil

    out, results = smoke_run
    shutil.copytree(out / "tiny-gla", tmp_path / "tiny-gla")
    before = {p.name: p.read_bytes() for p in (tmp_path / "tiny-gla").iterdir()}

    def broken_eval(*args, **kwargs):
        raise RuntimeError("simulated crash during evaluation")

    monkeypatch.setattr(train_tiny, "heldout_metrics", broken_eval)
    settings = train_tiny.TrainSettings(**results["tiny-gla"]["settings"])
    model = train_tiny.build_model(train_tiny.MODEL_SPECS["tiny-gla"], 320, smoke=True, seed=9)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_tiny.write_model(train_tiny.MODEL_SPECS["tiny-gla"], model, settings, results["tiny-gla"]["train"],
                               tmp_path, "python scripts/train_tiny.py", 0.0)
    assert {p.name: p.read_bytes() for p in (tmp_path / "tiny-gla").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-gla"]


def test_register_only_rewrites_entries_and_refuses_untrained(smoke_run):
    out, _ = smoke_run
    registry = out / "registry.json"
    entries = json.loads(registry.read_text())
    entries["tiny-gla"]["description"] = "stale"
    entries["someone-else"] = {"path": "elsewhere", "description": "kept", "default": False}
    registry.write_text(json.dumps(entries))
    train_tiny.main(["--register-only", "--models", "tiny-gla", "--out", str(out)])
    entries = json.loads(registry.read_text())
    description = entries["tiny-gla"]["description"]
    assert description.startswith("GLA") and "held-out perplexity" in description
    assert entries["someone-else"]["description"] == "kept"
    with pytest.raises(FileNotFoundError, match="tiny-gdn"):
        train_tiny.main(["--register-only", "--models", "tiny-gdn", "--out", str(out)])


def test_transformer_reference_generates_through_the_adapter(smoke_run):
    # The softmax-attention reference is a plain transformers Llama: it loads through the project's
    # loader (no CCQ: asking for it is an error) and the lm-eval adapter's KV-cache generation gives
    # greedy full recomputation's text.
    from adapter_support import greedy_full_recompute
    from lm_eval.api.instance import Instance

    from ccq_eval.harness.adapter import CCQEvalLM
    from ccq_eval.model.loading import ModelLoadError

    out, _ = smoke_run
    model, tokenizer = load_model(str(out / "tiny-transformer"), dtype="float64")
    assert type(model).__name__ == "LlamaForCausalLM"
    with pytest.raises(ModelLoadError, match="has no CCQ"):
        load_model(str(out / "tiny-transformer"), ccq=True)
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=2)
    prompts = ["Record: the pass code for north-star is 1234567. What is the pass code for north-star?",
               "The lamp is lit. On we walk.", "Home before dark", "Home before dusk"]
    requests = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 10, "do_sample": False}), 0,
                         metadata=("t", i, 1)) for i, p in enumerate(prompts)]
    for prompt, output in zip(prompts, lm.generate_until(requests), strict=True):
        expected = greedy_full_recompute(model, tokenizer.encode(prompt, add_special_tokens=False), 10,
                                         stop_ids={tokenizer.eos_token_id})
        assert output == tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("name", ["tiny-gla-ccq", "tiny-gdn-ccq"])
def test_read_path_freeze_keeps_every_query_and_key_input_fixed(name):
    spec = train_tiny.MODEL_SPECS[name]
    model = train_tiny.build_model(spec, 320, smoke=True, seed=0)
    pattern = train_settings.FREEZE_PRESETS["read-path"]
    groups = train_tiny.trainable_groups(model, ccq=True, weight_decay=0.1, train_parts="backbone", freeze=pattern)
    trained = {id(p) for group in groups for p in group["params"]}
    names = {n: id(p) in trained for n, p in model.named_parameters()}
    read_inputs = ("embeddings", "attn_norm", "q_proj", "k_proj", "q_conv1d", "k_conv1d", "ccq_gate")
    decay = ("a_proj", "A_log", "dt_bias") if "gdn" in name else ("gk_proj",)
    for param_name, is_trained in names.items():
        frozen_kind = any(part in param_name for part in read_inputs + decay)
        assert is_trained != frozen_kind, param_name
    assert any(names.values()) and sum(names.values()) < len(names)
    with pytest.raises(SystemExit, match="matches no parameter"):
        train_tiny.trainable_groups(model, ccq=True, weight_decay=0.1, freeze="no_such_parameter")


def test_bad_freeze_pattern_is_refused():
    with pytest.raises(SystemExit, match="--freeze"):
        train_settings.settings_from_args(train_settings.parse_args(["--smoke", "--freeze", "q_proj("]))


def test_heldout_metrics_use_bf16_only_where_the_cuda_kernel_refuses_fp32():
    """DeltaNet's chunk_delta_rule refuses fp32 on CUDA: its held-out metrics run under bf16 autocast there,
    every other family (and every family on the CPU) in fp32."""
    from types import SimpleNamespace

    def model_of(model_type):
        return SimpleNamespace(config=SimpleNamespace(model_type=model_type))

    precision = train_tiny.heldout_precision(model_of("delta_net"), "cuda")
    assert isinstance(precision, torch.autocast) and precision.fast_dtype == torch.bfloat16
    for model_type, device in (("delta_net", "cpu"), ("kda", "cuda"), ("gla", "cuda"), ("llama", "cuda")):
        assert not isinstance(train_tiny.heldout_precision(model_of(model_type), device), torch.autocast)
