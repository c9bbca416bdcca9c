"""A quick check, on a GPU, that the fused CCQ kernels compile and run (forward with raw keys and the
gate, forward + backward from a zero state): scripts/gpu_session.sh falls back to the unfused path
for the benchmarks when this fails. Exit code 0 when all are finite."""

import torch

import ccq_eval  # noqa: F401
from ccq_eval.ccq import CCQGate, ccq_read_chunk, ccq_read_keys, unit_keys

for K in (64, 128, 256):
    r = torch.randn(1, 300, 2, K, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 300, 2, K, device="cuda", dtype=torch.bfloat16)
    log_gamma = torch.nn.functional.logsigmoid(torch.randn(1, 300, 2, device="cuda") + 3)
    gate = CCQGate(torch.randn(2, K, device="cuda"), torch.zeros(2, device="cuda"), 4.0)
    with torch.no_grad():
        q, _ = ccq_read_keys(r, k, log_gamma, gate)
    leaves = [x.clone().requires_grad_(True) for x in (r, unit_keys(k), log_gamma, gate.values(r))]
    q2, _ = ccq_read_chunk(*leaves)
    grads = torch.autograd.grad(q2.float().square().sum(), leaves)
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(x).all()) for x in (q, q2, *grads))
    print(f"K={K}: fused forward and backward ran, finite={finite}")
    if not finite:
        raise SystemExit(1)
