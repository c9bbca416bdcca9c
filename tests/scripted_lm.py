"""An lm-eval model that answers each generation request with a function of its prompt, for running our
generate_until tasks through lm-eval's own evaluator without a real model (the task tests' perfect or
deliberately wrong readers)."""

from __future__ import annotations

from collections.abc import Callable

from lm_eval.api.model import LM


class ScriptedLM(LM):
    """generate_until answers answer(prompt) and keeps the requests it saw; our RULER and S-NIAH tasks only
    generate, so the scoring requests are errors."""

    def __init__(self, answer: Callable[[str], str]):
        super().__init__()
        self.answer = answer
        self.requests = []

    def generate_until(self, requests, disable_tqdm: bool = False):
        self.requests.extend(requests)
        return [self.answer(req.args[0]) for req in requests]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("the task only generates")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("the task only generates")
