"""Per-token log-probability and greedy match from logits, without an fp32 copy of the logits.

Scoring needs, at each position, log softmax(logits)[target] and whether the target is the argmax.
In torch that is an fp32 copy of the [positions, vocab] logits plus several passes over it (logsumexp
alone reads it more than once), a noticeable share of a small model's forward. On CUDA one Triton pass
(the default; CCQ_EVAL_TOKEN_LOGPROB=torch selects torch) reads the model's own (bf16) logits once, with
fp32 running max / sum-exp (the online softmax), the target's logit and the first argmax.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ccq_eval.model.kernels.triton_device import launches_on_input_device


@triton.jit
def _token_logprob_kernel(logits, targets, logprob_out, greedy_out, V, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets + row)
    offs = tl.arange(0, BLOCK)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int64)
    target_logit = tl.full([], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK):
        index = v0 + offs
        ok = index < V
        x = tl.load(logits + row * stride_row + index, mask=ok, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        new_max = tl.maximum(running_max, block_max)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
        # Strict >: a tie keeps the earlier (lower) index, as torch.argmax does.
        best_index = tl.where(block_max > best, v0 + tl.argmax(x, 0).to(tl.int64), best_index)
        best = tl.maximum(best, block_max)
        target_logit += tl.sum(tl.where(index == target, x, 0.0), 0)
    tl.store(logprob_out + row, target_logit - (running_max + tl.log(running_sum)))
    tl.store(greedy_out + row, best_index == target)


ENV_VAR = "CCQ_EVAL_TOKEN_LOGPROB"


def selected_implementation() -> str:
    """"triton" (the default, CUDA only) or "torch", from CCQ_EVAL_TOKEN_LOGPROB."""
    choice = os.environ.get(ENV_VAR, "triton").strip().lower()
    if choice not in ("triton", "torch"):
        raise ValueError(f"{ENV_VAR} must be 'triton' or 'torch', got {choice!r}")
    return choice


def token_logprob(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), target == argmax) for logits [..., V] and targets [...]: fp32 and bool."""
    shape = targets.shape
    if logits.shape[:-1] != shape:
        raise ValueError(f"token_logprob: logits {tuple(logits.shape)} do not match targets {tuple(shape)}")
    if not logits.is_cuda or selected_implementation() == "torch":
        scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logprob = scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scores, dim=-1)
        return logprob, scores.argmax(-1) == targets
    logprob, greedy = token_logprob_triton(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return logprob.view(shape), greedy.view(shape)


@launches_on_input_device
def token_logprob_triton(flat: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton pass on logits [rows, V] (CUDA; CPU tensors under TRITON_INTERPRET=1)."""
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, V = flat.shape
    logprob = torch.empty(rows, device=flat.device, dtype=torch.float32)
    greedy = torch.empty(rows, device=flat.device, dtype=torch.bool)
    if rows:
        _token_logprob_kernel[(rows,)](flat, targets.contiguous(), logprob, greedy, V, flat.stride(0),
                                       BLOCK=4096, num_warps=8)
    return logprob, greedy
