"""Run by tests/model/test_fla_untouched.py in fresh processes: what a plain fla model computes, with or
without ccq-eval having built and run its CCQ models in the same process, and whether any attribute of
fla's modules changed meanwhile. Prints one JSON object.

    python _fla_untouched_checks.py plain DEVICE                  # never imports ccq_eval
    python _fla_untouched_checks.py after-ccq DEVICE [ARCHS]      # builds and runs CCQ models first

ARCHS (comma-separated, default "gla,gated_deltanet") picks the CCQ models the after-ccq side runs, so that
on a GPU one process per architecture can tune fla's kernels side by side.
"""

import hashlib
import importlib
import json
import sys
import types
import warnings

import torch
from fla.models import GLAConfig, GLAForCausalLM

warnings.filterwarnings("ignore")
# fla's models, layers, modules and ops, as a user's process has them, and the ops the Hopper fix builds on
for module_name in ("fla", "fla.ops.gated_delta_rule.chunk", "fla.ops.simple_gla.chunk"):
    importlib.import_module(module_name)

_MISSING = object()


def fla_attributes() -> dict:
    """(module, attribute[, member]) -> object for every attribute of every loaded fla module, every member
    of the classes fla defines and every entry of fla's module-level dicts (ACT2FN, registries)."""
    found = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "fla" or module_name.startswith("fla.")):
            continue
        for name, value in list(vars(module).items()):
            found[(module_name, name)] = value
            if isinstance(value, type) and value.__module__.startswith("fla"):
                for member, member_value in list(vars(value).items()):
                    found[(module_name, name, member)] = member_value
            elif isinstance(value, dict):
                for key, entry in list(value.items()):
                    found[(module_name, name, repr(key))] = entry
    return found


def tuner_state(tuner) -> tuple:
    """What code that steered a triton autotuner would touch: (the autotuner, its candidate list and a copy
    of it, whether it has a prune_configs of its own, the winner table it holds and a copy of that table)."""
    return (tuner, tuner.configs, list(tuner.configs), "prune_configs" in vars(tuner), tuner.cache,
            dict(tuner.cache))


def autotuner_state() -> dict:
    """(module, attribute) -> tuner_state of each triton autotuner of fla."""
    from triton.runtime.autotuner import Autotuner

    state = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "fla" or module_name.startswith("fla.")):
            continue
        for name, value in list(vars(module).items()):
            for _ in range(4):
                if isinstance(value, Autotuner):
                    state[f"{module_name}.{name}"] = tuner_state(value)
                value = getattr(value, "fn", None)
    return state


def steered_autotuners(before: dict, after: dict) -> list[str]:
    """The autotuners of `before` whose tuning was steered by then: one whose candidates changed, that
    gained or lost a prune_configs of its own, holds another winner table, lost or replaced a winner, or has
    a winner that is not one of its candidates. A winner added from its own candidates is triton tuning the
    kernel as it always does (on a GPU every kernel that ran has one), not a change."""
    steered = []
    for name, (tuner, configs, candidates, own_prune, table, winners) in before.items():
        _, configs_now, candidates_now, own_prune_now, table_now, winners_now = after.get(
            name, (tuner, None, [], None, None, {}))
        own_candidates = {str(config) for config in candidates}
        if (configs_now is not configs or candidates_now != candidates or own_prune_now != own_prune
                or table_now is not table
                or any(winners_now.get(key, _MISSING) is not config for key, config in winners.items())
                or any(str(config) not in own_candidates for config in winners_now.values())):
            steered.append(name)
    return sorted(steered)


def changed_attributes(before: dict, after: dict) -> list[str]:
    """Attributes replaced or removed since `before`, and new ones other than submodules (a submodule
    imported later appears on its package)."""
    changes = [f"{'.'.join(key)}: replaced or removed" for key, value in before.items()
               if after.get(key, _MISSING) is not value]
    changes += [f"{'.'.join(key)}: added" for key, value in after.items()
                if key not in before and len(key) == 2 and key[0] in {k[0] for k in before}
                and not isinstance(value, types.ModuleType)]
    return sorted(changes)


def run_ccq_models(device: str, archs: list[str]) -> float:
    """Build the CCQ models of `archs` (CCQ-GLA "gla", CCQ-Gated-DeltaNet "gated_deltanet"; CCQ on), run
    prefill, a decode step, loss and backward on `device` as ccq-eval runs them; returns the sum of the
    logits (a finite number says they ran)."""
    from fla.models.utils import Cache

    from ccq_eval.model.modeling_ccq import (
        CCQGatedDeltaNetConfig,
        CCQGatedDeltaNetForCausalLM,
        CCQGLAConfig,
        CCQGLAForCausalLM,
        prepare_runtime,
    )

    prepare_runtime()
    torch.manual_seed(1)
    common = {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "vocab_size": 128,
              "intermediate_size": 128, "ccq": True, "ccq_gate_bias_init": 1.0}
    builders = {"gla": lambda: CCQGLAForCausalLM(CCQGLAConfig(use_short_conv=True, **common)),
                "gated_deltanet": lambda: CCQGatedDeltaNetForCausalLM(CCQGatedDeltaNetConfig(head_dim=16, **common))}
    unknown = sorted(set(archs) - set(builders))
    if unknown:
        sys.exit(f"unknown architecture {unknown}: use {sorted(builders)}")
    models = [builders[arch]() for arch in archs]
    total = 0.0
    ids = torch.randint(0, 128, (1, 80), device=device)
    for model in models:
        model.to(device)
        loss = model(ids, labels=ids).loss
        loss.backward()
        with torch.no_grad():
            cache = Cache()
            model.eval()(ids[:, :79], past_key_values=cache, use_cache=True)
            total += model(ids[:, 79:], past_key_values=cache, use_cache=True).logits.float().sum().item()
        total += loss.item()
    return total


def plain_fla_outcome(device: str) -> dict:
    """A seeded plain fla GLA model: the SHA-256 of each module's output, in call order, and of the logits,
    or the error where fla stops (on CPU fla's triton kernels do not run)."""
    torch.manual_seed(0)
    model = GLAForCausalLM(GLAConfig(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=128,
                                     intermediate_size=128, use_short_conv=True, fuse_norm=False,
                                     fuse_swiglu=False)).to(device).eval()
    digests = []

    def record(module, args, output):
        tensor = output[0] if isinstance(output, tuple) else output
        if isinstance(tensor, torch.Tensor):
            data = tensor.detach().float().cpu().contiguous().numpy().tobytes()
            digests.append(f"{type(module).__name__}:{hashlib.sha256(data).hexdigest()}")

    for module in model.modules():
        module.register_forward_hook(record)
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(2)).to(device)
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
        error = None
    except Exception as exc:  # noqa: BLE001  (the outcome to compare, whatever fla raises)
        error = f"{type(exc).__name__}: {exc}"
    return {"module_outputs": digests, "error": error}


def main(mode: str, device: str, archs: str = "gla,gated_deltanet") -> None:
    result = {}
    if mode == "after-ccq":
        before, tuners_before = fla_attributes(), autotuner_state()
        result["ccq_logits_sum"] = run_ccq_models(device, archs.split(","))
        result["changed"] = changed_attributes(before, fla_attributes())
        result["autotuners"] = len(tuners_before)
        result["autotuners_changed"] = steered_autotuners(tuners_before, autotuner_state())
    elif mode != "plain":
        sys.exit(f"unknown mode {mode!r}: use 'plain' or 'after-ccq'")
    result["plain"] = plain_fla_outcome(device)
    result["ccq_eval_imported"] = "ccq_eval" in sys.modules
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])
