"""Every model family: the list read off fla's and transformers' registrations, where each runs, the errors
a checkpoint of an unknown or CPU-less family gets, and, per family that runs on the CPU, a tiny random
checkpoint loaded by ccq-eval's loader whose adapter scores exactly as the model's own forward and decodes
exactly as the model's own greedy generate()."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import fla.models
import pytest
import torch
from adapter_support import full_token_nll, one_torch_thread  # noqa: F401
from family_support import CPU_FAMILIES, byte_level_tokenizer, tiny_checkpoint
from lm_eval.api.instance import Instance
from transformers import PretrainedConfig

from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.model.families import ONE_TOKEN_CACHE_LAYERS, family_of, fla_families
from ccq_eval.model.loading import ModelLoadError, load_model

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness"


def test_every_causal_lm_fla_registers_is_a_family():
    configs = [value for name in fla.models.__all__
               if inspect.isclass(value := getattr(fla.models, name)) and issubclass(value, PretrainedConfig)]
    families = fla_families()
    assert len(families) >= 35
    for config_class in configs:
        family = families[config_class.model_type]
        assert family.config_class is config_class and family.model_class.__module__.startswith("fla.models.")
    assert family_of("llama").source == family_of("qwen2").source == family_of("mistral").source == "transformers"
    assert family_of("gla").has_ccq and family_of("ccq_gated_deltanet").has_ccq and not family_of("kda").has_ccq
    assert family_of("not_a_family") is None


def test_the_one_token_cache_layers_are_those_whose_fla_code_says_so():
    """families.ONE_TOKEN_CACHE_LAYERS holds exactly the fla layer modules that refuse a several-token slice
    through a cache holding a state (the adapter scores texts through them in one forward)."""
    import fla.layers

    refusing = {f"fla.layers.{path.stem}" for path in Path(fla.layers.__file__).parent.glob("*.py")
                if "cached decoding only supports a single new token" in path.read_text(encoding="utf-8")}
    assert refusing == {layer.partition(":")[0] for layer in ONE_TOKEN_CACHE_LAYERS}
    assert not family_of("mamba2").sliced_cache and family_of("gla").sliced_cache


@pytest.mark.parametrize("model_type", CPU_FAMILIES)
def test_the_promised_families_run_on_the_cpu(model_type):
    assert family_of(model_type).cpu_blocker is None


@pytest.mark.parametrize("model_type", ["transformer", "gsa"])
def test_a_family_without_cpu_ops_stops_before_loading_in_one_line(tmp_path, model_type):
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))  # no weights: never read
    with pytest.raises(ModelLoadError) as error:
        load_model(str(folder))
    message = str(error.value)
    assert "\n" not in message and str(folder) in message and f"a {model_type} model cannot run on cpu" in message
    assert "--device cuda" in message


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("attn", {"layers": [1], "num_heads": 2}, r"softmax attention \(flash-attn, GPU only\)"),
    ("attnres_block_size", 2, r"attention residuals .* triton-only"),
])
def test_a_config_with_gpu_only_parts_stops_on_the_cpu(tmp_path, field, value, reason):
    folder = tiny_checkpoint("kda", tmp_path / "kda")
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=reason + ".*--device cuda"):
        load_model(str(folder))


def test_unknown_family_remote_code_and_mismatched_weights_are_named(tmp_path):
    folder = tiny_checkpoint("mamba", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mamba9", "auto_map": {"x": "y"}}))
    with pytest.raises(ModelLoadError, match=r"config\.json: unknown model_type 'mamba9'.*fla \(0\.6\.0\).*"
                                             r"ccq-eval models --families.*auto_map"):
        load_model(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match=r"weights lack .* tensors the config needs"):
        load_model(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(ModelLoadError, match=r"does not match the tensor shapes of its weights"):
        load_model(str(folder))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"model_type .mamba. has no CCQ"):
        load_model(str(folder), ccq=True)


@pytest.mark.parametrize("model_type", ["mamba", *CPU_FAMILIES])
def test_the_adapter_scores_and_decodes_as_the_model_itself(tmp_path, model_type):
    """Per family: the loader's model (float64) in the adapter: rolling log-likelihood equals one full
    forward of the model, greedy generate_until equals the model's own greedy generate()."""
    folder = tiny_checkpoint(model_type, tmp_path / model_type)
    model, tokenizer = load_model(str(folder), dtype="float64")
    saved = byte_level_tokenizer(model_type)
    assert tokenizer.encode(TEXT, add_special_tokens=False) == saved.encode(TEXT, add_special_tokens=False)
    # 37 divides neither the text nor the prompt: partial slices through the carried cache
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, chunk_size=37)
    (value,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (TEXT,), 0)])
    reference = full_token_nll(model, tokenizer.encode(TEXT, add_special_tokens=False))
    assert torch.allclose(torch.tensor(value.token_nll, dtype=torch.float64), reference, atol=1e-8, rtol=0)

    prompt = "Once upon a time, in a land far away"
    (text,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 12}), 0)])
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=tokenizer.pad_token_id)
    assert text == tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("model_type", ["delta_net", "kda", "rwkv7", "mamba", "mamba2"])
def test_prompts_of_different_lengths_decode_together_as_alone(tmp_path, model_type):
    """CPU generation batch: prompts prefilled one by one, their recurrent states stacked and decoded
    together, give each prompt's batch-1 answer (the Mamba family too: each prompt's prefill starts from an
    empty cache, and every decode step feeds one token, as its cache asks)."""
    from ccq_eval.harness.model_runtime import ModelRuntime

    model, tokenizer = load_model(str(tiny_checkpoint(model_type, tmp_path / model_type)), dtype="float64")
    prompts = ["Once upon a time", "It was the best of times, it was", "Call me", "A tale of two cities."]
    requests = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 9}), i) for i, p in enumerate(prompts)]
    rows = []
    hook = ModelRuntime(model).backbone.register_forward_pre_hook(lambda module, args, kwargs: rows.append(
        kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        together = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=3, chunk_size=16).generate_until(requests)
    finally:
        hook.remove()
    assert max(rows) == 3  # decode steps of three stacked states
    alone = [CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=1).generate_until([request])[0]
             for request in requests]
    assert together == alone


def test_only_measured_families_take_the_cuda_fast_path_by_default():
    from ccq_eval.harness.adapter import resolve_fast_path

    assert family_of("kda").gpu_fast_path_measured and not family_of("retnet").gpu_fast_path_measured
    assert resolve_fast_path("cuda", True, None, None, measured=False) == (1, False)
    assert resolve_fast_path("cuda", True, None, True, measured=False) == (None, True)  # asked for: allowed
    assert resolve_fast_path("cuda", True, None, None, measured=True) == (None, True)


def test_mamba2_default_fused_loss_runs_on_the_cpu():
    """fla's Mamba2 derives from FLAPreTrainedModel alone, not FLAForCausalLM: its fused loss (on by
    default) is still built as the backend's class, and equals the plain cross entropy of its logits."""
    import torch.nn.functional as F
    from family_support import COMMON, SHAPES
    from transformers import AutoConfig, AutoModelForCausalLM

    from ccq_eval.model import fla_cpu

    config = AutoConfig.for_model("mamba2", **COMMON, **SHAPES["mamba2"])
    assert config.fuse_cross_entropy
    model = fla_cpu.use_torch_backend(AutoModelForCausalLM.from_config(config)).double()
    ids = torch.randint(3, 259, (2, 40))
    loss = model(input_ids=ids, labels=ids).loss
    logits = model(input_ids=ids).logits
    assert torch.allclose(loss, F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()), atol=1e-10)


def test_float32_on_cuda_is_refused_in_one_line_for_families_whose_kernel_refuses_it(tmp_path):
    """fla's chunk_delta_rule asserts its inputs are not float32: DeltaNet (and its CCQ type) on CUDA in
    float32 stops before loading, naming the checkpoint, the kernel and --dtype bfloat16; other families and
    other dtypes pass (the check reads only the config, so it runs on a machine without CUDA)."""
    from ccq_eval.model.families import CUDA_HALF_ONLY_LAYERS
    from ccq_eval.model.loading import check_runs_on

    delta_net = tiny_checkpoint("delta_net", tmp_path / "delta_net")
    with pytest.raises(ModelLoadError, match=r"delta_net model cannot run in float32 on cuda: fla's "
                                             r"chunk_delta_rule refuses float32 on CUDA; run it with --dtype bfloat16"):
        check_runs_on(delta_net, "cuda", "float32")
    for dtype in ("bfloat16", "auto", None):
        check_runs_on(delta_net, "cuda", dtype)
    check_runs_on(tiny_checkpoint("kda", tmp_path / "kda"), "cuda", "float32")
    assert family_of("ccq_delta_net").cuda_float32_blocker == family_of("delta_net").cuda_float32_blocker
    # every layer named is one fla ships, and its kernel still refuses float32 in fla's source
    for layer, kernel in CUDA_HALF_ONLY_LAYERS.items():
        module_name, _, class_name = layer.partition(":")
        module = __import__(module_name, fromlist=[class_name])
        assert hasattr(module, class_name)
        op_module = __import__(f"fla.ops.{kernel.removeprefix('chunk_')}.chunk", fromlist=[kernel])
        assert "does not support float32" in inspect.getsource(getattr(op_module, kernel))
