"""A quick check, on a GPU, that the fused kernels compile, run and agree with their references:
the CCQ forward with raw keys and the gate (bf16 and fp32, from a state), one decoding step and the
CCQ backward from a zero state (fp32), all against fp64 on CPU; the fused log-softmax against torch.
scripts/gpu_session.sh falls back to the unfused path for the benchmarks when this fails. Prints the
relative L2 errors; exit code 1 if one is over tolerance."""

import os
import sys

import torch

from ccq_eval.model.ccq import CCQGate, CCQState, ccq_read_chunk, ccq_read_keys, unit_keys
from ccq_eval.model.kernels.token_logprob import token_logprob
from ccq_eval.model.modeling_ccq import prepare_runtime

prepare_runtime()  # the CCQ model types in transformers' Auto classes


def run(kernel, fn):
    os.environ["CCQ_EVAL_CCQ_KERNEL"] = kernel
    try:
        return fn()
    finally:
        os.environ.pop("CCQ_EVAL_CCQ_KERNEL")


def cpu64(*tensors):
    return tuple(x.double().cpu() for x in tensors)


def relative(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


failed = []
g = torch.Generator(device="cuda").manual_seed(0)
for K in (128, 256):
    T, H = 1000, 2
    r32 = torch.randn(1, T, H, K, device="cuda", generator=g)
    k32 = 2 * torch.randn(1, T, H, K, device="cuda", generator=g)
    log_gamma = torch.nn.functional.logsigmoid(torch.randn(1, T, H, device="cuda", generator=g) + 3)
    gate = CCQGate(0.2 * torch.randn(H, K, device="cuda", generator=g), torch.zeros(H, device="cuda"), 4.0)
    kap0 = unit_keys(torch.randn(1, 30, H, K, device="cuda", generator=g))
    state = CCQState(torch.einsum("bthk,bthl->bhkl", kap0, kap0), kap0.sum(1), torch.full((1, H), 30.0, device="cuda"))
    # The forward references: the same inputs in fp64 on CPU (the unfused path on CUDA would use
    # fla's kernels, whose fp32 products are tf32).
    cpu64_gate = CCQGate(*cpu64(gate.weight, gate.bias), gate.lam_max)
    cpu64_state = CCQState(*cpu64(*state))
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        r, k = r32.to(dtype), k32.to(dtype)
        with torch.no_grad():
            fused = run("fused", lambda: ccq_read_keys(r, k, log_gamma, gate, initial_state=state))  # noqa: B023 (runs at once)
            ref = ccq_read_keys(*cpu64(r32, k32, log_gamma), cpu64_gate, initial_state=cpu64_state)
        errors = [relative(fused[0], ref[0])] + [relative(a, b) for a, b in zip(fused[1], ref[1])]
        print(f"forward K={K} {dtype}: relative errors q, P, m, n = {[f'{e:.1e}' for e in errors]}")
        if not max(errors) < tol:
            failed.append(f"forward K={K} {dtype}")
        with torch.no_grad():  # one decoding step from that state
            step = [run("fused", lambda: ccq_read_keys(r[:, :1], k[:, :1], log_gamma[:, :1], gate,  # noqa: B023
                                                       initial_state=state)),  # noqa: B023 (runs at once)
                    ccq_read_keys(*cpu64(r32[:, :1], k32[:, :1], log_gamma[:, :1]), cpu64_gate,
                                  initial_state=cpu64_state)]
        errors = [relative(step[0][0], step[1][0])] + [relative(a, b) for a, b in zip(step[0][1], step[1][1])]
        print(f"decode step K={K} {dtype}: relative errors q, P, m, n = {[f'{e:.1e}' for e in errors]}")
        if not max(errors) < tol:
            failed.append(f"decode K={K} {dtype}")
    weights = torch.randn(r32.shape, device="cuda", generator=g)

    def grads(cast):
        leaves = [cast(x).requires_grad_(True) for x in (r32, unit_keys(k32), log_gamma, gate.values(r32))]  # noqa: B023
        q, _ = ccq_read_chunk(*leaves)
        return torch.autograd.grad((q * cast(weights)).sum(), leaves)  # noqa: B023 (grads runs in this iteration)

    # Reference: autograd through the chunk form in fp64 on CPU (fla's fp32 kernels multiply in tf32).
    errors = [relative(a, b) for a, b in zip(run("fused", lambda: grads(torch.Tensor.clone)),
                                             grads(lambda x: x.detach().double().cpu()))]
    print(f"backward K={K} fp32: relative errors dr, dkappa, dlog_gamma, dlam = {[f'{e:.1e}' for e in errors]}")
    if not max(errors) < 1e-3:
        failed.append(f"backward K={K}")

logits = (4 * torch.randn(300, 32000, device="cuda", generator=g)).bfloat16()
targets = torch.randint(0, 32000, (300,), device="cuda", generator=g)
targets[:50] = logits[:50].float().argmax(-1)
os.environ["CCQ_EVAL_TOKEN_LOGPROB"] = "triton"
lp, greedy = token_logprob(logits, targets)
os.environ["CCQ_EVAL_TOKEN_LOGPROB"] = "torch"
lp_ref, greedy_ref = token_logprob(logits, targets)
os.environ.pop("CCQ_EVAL_TOKEN_LOGPROB")
error = (lp - lp_ref).abs().max().item()
print(f"token_logprob bf16: max |diff| vs torch {error:.1e}, greedy equal {torch.equal(greedy, greedy_ref)}")
if not (error < 1e-3 and torch.equal(greedy, greedy_ref)):
    failed.append("token_logprob")
torch.cuda.synchronize()
print("FAILED: " + ", ".join(failed) if failed else "all fused kernels agree with their references")
sys.exit(1 if failed else 0)
