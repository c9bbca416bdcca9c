"""transformers users load the CCQ checkpoints with AutoModelForCausalLM after `import ccq_eval.model.auto`,
and get the model ccq_eval's own loader builds. In a fresh interpreter, since registration is per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, torch
from transformers import AutoModelForCausalLM
import ccq_eval.model
from ccq_eval.model.registry import MODELS_DIR

folder = MODELS_DIR / "tiny-gla-ccq"
try:
    AutoModelForCausalLM.from_pretrained(folder)
    unregistered = "loaded"
except (ValueError, KeyError) as error:
    unregistered = str(error)

import ccq_eval.model.auto

auto = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
from ccq_eval.model.loading import load_model

ours, tokenizer = load_model("tiny-gla-ccq", device="cpu", dtype="float32")
ids = torch.tensor([tokenizer.encode("The special magic number is 7", add_special_tokens=False)])
with torch.no_grad():
    auto_logits, our_logits = auto(ids).logits, ours(ids).logits
print(json.dumps({"unregistered": unregistered, "class": type(auto).__name__, "ccq": auto.config.ccq,
                  "max_difference": (auto_logits - our_logits).abs().max().item(),
                  "scale": our_logits.abs().max().item(), "shape": list(auto_logits.shape)}))
"""


@pytest.mark.slow  # a fresh Python process that imports transformers and fla and loads the model twice
def test_auto_classes_load_the_ccq_checkpoint_after_the_import():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # before the import: transformers' own error names the unknown type
    assert "ccq_gla" in report["unregistered"]
    assert report["class"] == "CCQGLAForCausalLM" and report["ccq"] is True
    assert report["shape"][:2] == [1, len("The special magic number is 7")] and report["scale"] > 0
    assert report["max_difference"] <= 1e-6 * report["scale"]
