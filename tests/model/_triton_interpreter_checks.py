"""Run by tests/model/test_ccq_triton.py in a subprocess with TRITON_INTERPRET=1, so that the fused CCQ
kernels execute on CPU tensors. Prints one JSON object: the measured errors per check."""

import json
import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("set TRITON_INTERPRET=1 (before triton is imported) to run these checks")

import _triton_bounds
import _triton_patch_once
import torch

_triton_bounds.install()  # every check below also fails on an out-of-bounds load or store
_triton_patch_once.install()

from ccq_eval.model.ccq import _FusedOrder1, ccq_read_reference, unit_keys  # noqa: E402
from ccq_eval.model.kernels.ccq_forward import ccq_order1_forward  # noqa: E402
from ccq_eval.model.modeling_ccq import prepare_runtime  # noqa: E402

prepare_runtime()  # the autotune cap and the CCQ model types, as in every other test


def inputs(B, T, H, K, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, H, K, generator=g)
    kappa = unit_keys(torch.randn(B, T, H, K, generator=g))
    log_gamma = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=g) + 3)
    lam = 4 * torch.rand(B, T, H, generator=g)
    return r.to(dtype), kappa.to(dtype), log_gamma, lam


def prior_state(B, H, K, seed):
    """A genuine state: the reference's sums after 9 earlier steps."""
    r, kappa, log_gamma, lam = inputs(B, 9, H, K, seed, torch.float64)
    return ccq_read_reference(r, kappa, log_gamma, lam)[1]


def max_abs(a, b):
    return (a.double() - b.double()).abs().max().item()


def forward_checks():
    out = {}
    cases = [  # B, T, H, K, chunk, centered, with a prior state
        (2, 150, 2, 64, 32, True, False),
        (1, 70, 2, 64, 32, False, True),
        (1, 90, 1, 128, 16, True, True),  # K over several tiles
        (1, 5, 1, 64, 16, True, False),  # shorter than one chunk
        (1, 600, 1, 64, 16, True, True),  # 38 chunks: 19 segments of 2, two groups of the segment scan
    ]
    for B, T, H, K, chunk, centered, with_state in cases:
        r, kappa, log_gamma, lam = inputs(B, T, H, K, seed=T + K)
        state = prior_state(B, H, K, seed=K) if with_state else None
        q_ref, s_ref = ccq_read_reference(r.double(), kappa.double(), log_gamma.double(), lam.double(),
                                          1, centered, state)
        q, final = ccq_order1_forward(r, kappa, log_gamma, lam, centered,
                                      None if state is None else tuple(s.float() for s in state),
                                      output_final_state=True, chunk_size=chunk)
        name = (f"B{B}_T{T}_H{H}_K{K}_C{chunk}_{'centered' if centered else 'uncentered'}_"
                f"{'state' if with_state else 'zero'}")
        # Errors relative to the size of the values (q ~ 1, P and n grow with the decayed count).
        out[name] = {"q": max_abs(q, q_ref),
                     "state": max(max_abs(a, b) / b.abs().max().item() for a, b in zip(final, s_ref))}
    # The state kernel's segments (chunks walked in series per program, then scanned): one segment
    # for all 38 chunks, and segments of 5 chunks with a ragged last one (the default above: 2).
    r, kappa, log_gamma, lam = inputs(1, 600, 1, 64, seed=5)
    state = prior_state(1, 1, 64, seed=6)
    q_ref, s_ref = ccq_read_reference(r.double(), kappa.double(), log_gamma.double(), lam.double(), 1, True, state)
    for segment in (38, 5):
        q, final = ccq_order1_forward(r, kappa, log_gamma, lam, True, tuple(s.float() for s in state),
                                      output_final_state=True, chunk_size=16, segment_chunks=segment)
        out[f"B1_T600_H1_K64_C16_segments_of_{segment}"] = {
            "q": max_abs(q, q_ref), "state": max(max_abs(a, b) / b.abs().max().item() for a, b in zip(final, s_ref))}
    # A row's result does not depend on the rows beside it: three rows in one call, bit for bit the
    # three rows alone (the segment length follows the length and heads, not the batch).
    r, kappa, log_gamma, lam = inputs(3, 600, 1, 64, seed=8)
    state = tuple(s.float() for s in prior_state(3, 1, 64, seed=9))
    q, final = ccq_order1_forward(r, kappa, log_gamma, lam, True, state, output_final_state=True, chunk_size=16)
    rows = [ccq_order1_forward(r[b:b + 1], kappa[b:b + 1], log_gamma[b:b + 1], lam[b:b + 1], True,
                               tuple(s[b:b + 1] for s in state), output_final_state=True, chunk_size=16)
            for b in range(3)]
    out["batch_rows_equal_single_rows"] = all(
        torch.equal(q[b:b + 1], q_row) and all(torch.equal(a[b:b + 1], c) for a, c in zip(final, final_row))
        for b, (q_row, final_row) in enumerate(rows))
    # The half-precision path (tl.dot in the input dtype, as bf16 on GPU; the interpreter has no bf16).
    r, kappa, log_gamma, lam = inputs(1, 130, 2, 64, seed=3)
    q_ref, _ = ccq_read_reference(r.double(), kappa.double(), log_gamma.double(), lam.double())
    q16, _ = ccq_order1_forward(r.half(), kappa.half(), log_gamma, lam)
    out["fp16_relative_l2"] = ((q16.double() - q_ref).norm() / q_ref.norm()).item()
    # Raw keys and the query gate, both formed inside the kernels (the inference path of the layers).
    from ccq_eval.model.ccq import CCQGate

    g = torch.Generator().manual_seed(11)
    r, _, log_gamma, _ = inputs(1, 100, 2, 64, seed=4)
    k = 3 * torch.randn(1, 100, 2, 64, generator=g)
    k[0, 7, 1] = 0.0  # a zero key: normalised by the 1e-6 floor, as unit_keys does
    state = prior_state(1, 2, 64, seed=2)
    for gate in (CCQGate(0.3 * torch.randn(2, 64, generator=g), torch.randn(2, generator=g), 4.0),
                 CCQGate(None, torch.randn(2, generator=g), 2.0)):
        q_ref, s_ref = ccq_read_reference(r.double(), unit_keys(k).double(), log_gamma.double(),
                                          gate.values(r).double(), 1, True, state)
        weight = torch.zeros(2, 64) if gate.weight is None else gate.weight
        q, final = ccq_order1_forward(r, k, log_gamma, None, True, tuple(x.float() for x in state),
                                      output_final_state=True, raw_keys=True, gate=(weight, gate.bias, gate.lam_max))
        name = "raw_keys_" + ("query_gate" if gate.weight is not None else "constant_gate")
        out[name] = {"q": max_abs(q, q_ref),
                     "state": max(max_abs(a, b) / b.abs().max().item() for a, b in zip(final, s_ref))}
    # lambda = 0 reads the query unchanged, bit for bit.
    q0, _ = ccq_order1_forward(r, kappa, log_gamma, torch.zeros_like(lam))
    out["lambda0_identical"] = bool(torch.equal(q0, r))
    return out


def gradient_checks():
    out = {}
    for centered, (B, T, H, K) in ((True, (2, 100, 2, 64)), (False, (2, 100, 2, 64)), (True, (1, 150, 1, 128)),
                                   (True, (1, 1100, 1, 64))):  # 18 chunks: two groups of the scans
        r, kappa, log_gamma, lam = inputs(B, T, H, K, seed=7)
        weights = torch.randn(r.shape, generator=torch.Generator().manual_seed(8))
        leaves = [x.double().requires_grad_(True) for x in (r, kappa, log_gamma, lam)]
        q_ref, _ = ccq_read_reference(*leaves, 1, centered)
        ref = torch.autograd.grad((q_ref * weights.double()).sum(), leaves)
        leaves = [x.clone().requires_grad_(True) for x in (r, kappa, log_gamma, lam)]
        q, *_ = _FusedOrder1.apply(*leaves, centered)
        got = torch.autograd.grad((q * weights).sum(), leaves)
        for name, a, b in zip(("r", "kappa", "log_gamma", "lam"), got, ref):
            out[f"{'centered' if centered else 'uncentered'}_K{K}_d{name}"] = (
                (a.double() - b).norm() / b.norm()).item()
    return out


def raw_key_gradient_checks():
    """Training on raw keys with the gate formed in the kernels (_FusedOrder1Keys) against autograd
    through unit_keys, the gate and ccq_read_reference in fp64: relative L2 error of every gradient,
    for the query gate and the constant gate, with one zero key (the 1e-6 floor of unit_keys)."""
    from ccq_eval.model.ccq import CCQGate, _FusedOrder1Keys

    out = {}
    g = torch.Generator().manual_seed(13)
    B, T, H, K = 1, 150, 2, 64
    r, _, log_gamma, _ = inputs(B, T, H, K, seed=14)
    k = 3 * torch.randn(B, T, H, K, generator=g)
    k[0, 5, 1] = 0.0
    weights = torch.randn(B, T, H, K, generator=g)
    for query_gate in (True, False):
        gate_weight = 0.3 * torch.randn(H, K, generator=g) if query_gate else None
        gate_bias = torch.randn(H, generator=g)
        leaves = [x.double().requires_grad_(True) for x in (r, k, log_gamma, gate_bias)]
        extra = [gate_weight.double().requires_grad_(True)] if query_gate else []
        gate64 = CCQGate(extra[0] if query_gate else None, leaves[3], 4.0)
        q_ref, _ = ccq_read_reference(leaves[0], unit_keys(leaves[1]), leaves[2], gate64.values(leaves[0]))
        ref = torch.autograd.grad((q_ref * weights.double()).sum(), leaves + extra)
        leaves32 = [x.clone().requires_grad_(True) for x in (r, k, log_gamma, gate_bias)]
        extra32 = [gate_weight.clone().requires_grad_(True)] if query_gate else []
        q, *_ = _FusedOrder1Keys.apply(leaves32[0], leaves32[1], leaves32[2], extra32[0] if query_gate else None,
                                       leaves32[3], 4.0, True)
        got = torch.autograd.grad((q * weights).sum(), leaves32 + extra32)
        names = ("r", "k", "log_gamma", "gate_bias") + (("gate_weight",) if query_gate else ())
        for name, a, b in zip(names, got, ref):
            out[f"{'query' if query_gate else 'constant'}_gate_d{name}"] = ((a.double() - b).norm() / b.norm()).item()
    # Gate parameters in half precision (a model cast to bf16 / fp16): gradients come back in their dtype.
    half = [x.half().requires_grad_(True) for x in (0.3 * torch.randn(H, K, generator=g), torch.randn(H, generator=g))]
    q, *_ = _FusedOrder1Keys.apply(r, k, log_gamma, half[0], half[1], 4.0, True)
    grads = torch.autograd.grad((q * weights).sum(), half)
    out["half_gate_parameters_dtype_mismatch"] = float(any(x.dtype != torch.float16 for x in grads))
    return out


def decode_checks():
    """Five decoding steps of the one-step kernel against ccq_read_recurrent, from a prior state."""
    from ccq_eval.model.ccq import CCQGate, ccq_read_recurrent
    from ccq_eval.model.kernels.ccq_decode import ccq_order1_decode

    g = torch.Generator().manual_seed(21)
    out = {}
    for K, centered, constant in ((64, True, False), (128, False, False), (64, True, True)):
        B, H, steps = 2, 2, 5
        r = torch.randn(B, steps, H, K, generator=g)
        k = 2 * torch.randn(B, steps, H, K, generator=g)
        log_gamma = torch.nn.functional.logsigmoid(torch.randn(B, steps, H, generator=g) + 3)
        gate = CCQGate(None if constant else 0.3 * torch.randn(H, K, generator=g), torch.randn(H, generator=g), 4.0)
        state_ref = tuple(x.double() for x in prior_state(B, H, K, seed=K))
        state = tuple(x.float() for x in state_ref)
        worst_q = worst_state = 0.0
        for t in range(steps):
            rt, kt, gt = r[:, t:t + 1], k[:, t:t + 1], log_gamma[:, t:t + 1]
            q_ref, state_ref = ccq_read_recurrent(rt.double(), unit_keys(kt).double(), gt.double(),
                                                  gate.values(rt).double(), 1, centered, state_ref)
            q, state = ccq_order1_decode(rt, kt, gt, (gate.weight, gate.bias, gate.lam_max), state, centered)
            worst_q = max(worst_q, max_abs(q, q_ref))
            worst_state = max(worst_state, max(max_abs(a, b) / b.abs().max().item() for a, b in zip(state, state_ref)))
        out[f"K{K}_{'centered' if centered else 'uncentered'}_{'constant' if constant else 'query'}_gate"] = {
            "q": worst_q, "state": worst_state}
    # Gate parameters in bf16 (a bf16 model's), converted in the kernel: the same step as with their
    # values in fp32, exactly.
    r, k = torch.randn(2, 1, 2, 64, generator=g), torch.randn(2, 1, 2, 64, generator=g)
    log_gamma = torch.full((2, 1, 2), -0.1)
    weight, bias = (0.3 * torch.randn(2, 64, generator=g)).bfloat16(), torch.randn(2, generator=g).bfloat16()
    state = prior_state(2, 2, 64, seed=3)
    q_bf16, state_bf16 = ccq_order1_decode(r, k, log_gamma, (weight, bias, 4.0), state)
    q_fp32, state_fp32 = ccq_order1_decode(r, k, log_gamma, (weight.float(), bias.float(), 4.0), state)
    out["K64_bf16_gate_parameters_vs_fp32"] = {
        "q": max_abs(q_bf16, q_fp32), "state": max(max_abs(a, b) for a, b in zip(state_bf16, state_fp32))}
    return out


def logprob_checks():
    """The fused log-softmax pass against torch, in fp32 and on bf16 logits, vocab not a block multiple."""
    from ccq_eval.model.kernels.token_logprob import token_logprob, token_logprob_triton

    g = torch.Generator().manual_seed(5)
    logits = 4 * torch.randn(37, 5000, generator=g)
    targets = torch.randint(0, 5000, (37,), generator=g)
    targets[:5] = logits[:5].argmax(-1)  # some rows where the target is the greedy choice
    logits[5, 4100] = logits[5, 10] = logits[5].max() + 1  # a tie across blocks: the first index wins
    targets[5] = 10
    out = {}
    for name, x in (("fp32", logits), ("bf16_as_fp32", logits.bfloat16().float())):
        ref_lp, ref_greedy = token_logprob(x, targets)  # the torch path (CPU tensors)
        lp, greedy = token_logprob_triton(x, targets)
        out[name] = {"max_abs_logprob": (lp - ref_lp).abs().max().item(),
                     "greedy_equal": bool(torch.equal(greedy, ref_greedy)),
                     "greedy_count": int(greedy.sum())}
    return out


def _tuned_kernels(module):
    from ccq_eval.model.kernels.ccq_chunk_states import FirstConfig

    return {name: x for name, x in vars(module).items() if isinstance(x, FirstConfig)}


def candidate_checks():
    """Every kernel with each of its autotune candidates (a GPU's autotuner may pick any of them),
    under the bounds check, at shapes like those that crashed on the H200: half precision, whole and
    ragged last chunks, several batches and heads, head dims 64 and 128. The i-th distinct candidate
    of every kernel (its last where it has fewer) runs together; a path (the forward kernels', the
    backward kernels') runs only where one of its kernels gets a candidate it has not run yet: the
    interpreter ignores num_warps and num_stages, and what a kernel computes depends on its inputs, not
    on the candidates the other kernels run with (their results are checked against fp64 too).
    Returns, per candidate and shape, the worst relative L2 error of each path run against fp64 (an
    out-of-bounds access raises _triton_bounds.OutOfBounds), each kernel's distinct candidates and
    those run, and whether the bounds check catches a planted overrun."""
    from ccq_eval.model.kernels import ccq_backward, ccq_decode, ccq_forward

    forward, backward = _tuned_kernels(ccq_forward), _tuned_kernels(ccq_backward)
    assert not _tuned_kernels(ccq_decode)  # the decoding step has no candidates: it runs once per shape
    tuned = forward | backward

    # Each kernel's distinct candidates by their constexprs, in the order of its configs.
    distinct = {name: list(dict.fromkeys(tuple(sorted(c.kwargs.items())) for c in kernel.configs))
                for name, kernel in tuned.items()}
    errors, runs = {}, {"forward": 0, "backward": 0}
    ran = {name: set() for name in tuned}
    for candidate in range(max(len(picks) for picks in distinct.values())):
        picks = {name: options[min(candidate, len(options) - 1)] for name, options in distinct.items()}
        paths = {path for path, kernels in (("forward", forward), ("backward", backward))
                 if any(picks[name] not in ran[name] for name in kernels)}
        if not paths:
            continue
        for path in paths:
            runs[path] += 1
            for name in (forward if path == "forward" else backward):
                ran[name].add(picks[name])
        for name, kernel in tuned.items():
            kernel.kwargs = dict(picks[name])
        errors.update(_every_kernel_once(candidate, paths, decode=not errors))
    candidates = {name: sorted({tuple(sorted(c.kwargs.items())) for c in kernel.configs})
                  for name, kernel in tuned.items()}
    return {"errors": errors, "candidates": candidates, "ran": {name: sorted(picks) for name, picks in ran.items()},
            "runs": runs, "overrun_caught": _overrun_is_caught()}


def _relative(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _every_kernel_once(candidate, paths, decode):
    """The paths asked for, each against fp64: "forward" (raw keys, gate, prior state), "backward"
    (forward + backward, zero state; given unit keys and lambda, and on raw keys with the gate), and,
    where `decode`, one decoding step: per shape, the worst relative L2 error of each one's outputs (None
    where not run). The backward's values only in fp32: in half precision it multiplies in bf16, and the
    interpreter's bf16 tl.dot returns garbage (a 16 x 16 product off by 1e9 relative, checked), so there
    it is run for the bounds alone."""
    from ccq_eval.model.ccq import CCQGate, ccq_read_recurrent
    from ccq_eval.model.kernels.ccq_decode import ccq_order1_decode

    out = {}
    # Ragged last chunks (T = 130: a split of three chunks in two is uneven too) and whole ones, in both
    # dtypes and head dims.
    for B, T, H, K, dtype in ((2, 130, 3, 64, torch.float16), (1, 192, 2, 128, torch.float16),
                              (2, 64, 2, 64, torch.float32), (2, 130, 2, 128, torch.float32)):
        r, kappa, log_gamma, lam = inputs(B, T, H, K, seed=T, dtype=dtype)
        r64, kappa64, lg64 = (x.double() for x in (r, kappa, log_gamma))
        state64 = prior_state(B, H, K, seed=1)
        state = tuple(x.float() for x in state64)
        g = torch.Generator().manual_seed(K)
        gate = CCQGate(0.3 * torch.randn(H, K, generator=g), torch.randn(H, generator=g), 4.0)
        kernel_gate = (gate.weight, gate.bias, gate.lam_max)
        gate64 = CCQGate(gate.weight.double(), gate.bias.double(), gate.lam_max)

        forward = backward = step_error = None
        if "forward" in paths:
            q, final = ccq_order1_forward(r, kappa, log_gamma, None, True, state, output_final_state=True,
                                          raw_keys=True, gate=kernel_gate)
            q_ref, final_ref = ccq_read_reference(r64, unit_keys(kappa64), lg64, gate64.values(r64), 1, True,
                                                  state64)
            forward = max(_relative(x, y) for x, y in zip((q, *final), (q_ref, *final_ref)))

        dq = torch.randn(B, T, H, K, generator=g).to(dtype)
        if "backward" in paths:
            backward = _backward_error(r, kappa, log_gamma, lam, dq, kernel_gate, gate, dtype)

        if decode:
            step = ccq_order1_decode(r[:, :1], kappa[:, :1], log_gamma[:, :1], kernel_gate, state)
            step_ref = ccq_read_recurrent(r64[:, :1], unit_keys(kappa64[:, :1]), lg64[:, :1],
                                          gate64.values(r64[:, :1]), 1, True, state64)
            step_error = max(_relative(x, y) for x, y in zip((step[0], *step[1]), (step_ref[0], *step_ref[1])))
        name = f"config{candidate}_B{B}_T{T}_H{H}_K{K}_{str(dtype).split('.')[-1]}"
        out[name] = {"forward": forward, "backward": backward, "decode": step_error, "paths": sorted(paths)}
    return out


def _backward_error(r, kappa, log_gamma, lam, dq, kernel_gate, gate, dtype):
    """Forward + backward against autograd in fp64, on unit keys and lambda and on raw keys with the gate:
    the worst relative L2 error of q and every gradient (None in half precision: run for the bounds)."""
    from ccq_eval.model.ccq import CCQGate
    from ccq_eval.model.kernels.ccq_backward import ccq_order1_backward

    r64, kappa64, lg64, lam64 = (x.double() for x in (r, kappa, log_gamma, lam))
    gate64 = CCQGate(gate.weight.double(), gate.bias.double(), gate.lam_max)
    q, _, chunk_states = ccq_order1_forward(r, kappa, log_gamma, lam, True, return_chunk_states=True)
    grads = ccq_order1_backward(r, kappa, log_gamma, lam, dq, *chunk_states)
    leaves = [x.clone().requires_grad_(True) for x in (r64, kappa64, lg64, lam64)]
    q_ref, _ = ccq_read_reference(*leaves, 1, True)
    grads_ref = torch.autograd.grad((q_ref * dq.double()).sum(), leaves)
    # The training path of the layers: raw keys and the gate's chain rules in the kernels.
    _, _, raw_states = ccq_order1_forward(r, kappa, log_gamma, None, True, return_chunk_states=True,
                                          raw_keys=True, gate=kernel_gate)
    dr, dk, dlg, dlogit, dweight = ccq_order1_backward(r, kappa, log_gamma, None, dq, *raw_states,
                                                       raw_keys=True, gate=kernel_gate)
    leaves = [x.clone().requires_grad_(True) for x in (r64, kappa64, lg64, gate64.weight, gate64.bias)]
    q_raw_ref, _ = ccq_read_reference(leaves[0], unit_keys(leaves[1]), leaves[2],
                                      CCQGate(leaves[3], leaves[4], gate.lam_max).values(leaves[0]))
    raw_ref = torch.autograd.grad((q_raw_ref * dq.double()).sum(), leaves)
    raw = (dr, dk, dlg, dweight, dlogit.sum((0, 1)))
    if dtype != torch.float32:
        return None
    return max(_relative(x, y) for x, y in zip((q, *grads, *raw), (q_ref, *grads_ref, *raw_ref)))


def _overrun_is_caught() -> bool:
    """The check itself: a load one element past a tensor's end must raise."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(x, y, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(y + offsets, tl.load(x + offsets))

    copy[(1,)](torch.ones(8), torch.zeros(8), N=8)
    try:
        copy[(1,)](torch.ones(8)[:7], torch.zeros(8), N=8)
    except Exception as error:  # noqa: BLE001  (the interpreter wraps it in InterpreterError)
        return "OutOfBounds" in repr(error)
    return False


if __name__ == "__main__":
    which = sys.argv[1:] or ["forward", "gradient", "raw_key_gradient", "logprob", "decode", "candidates"]
    result = {}
    if "forward" in which:
        result["forward"] = forward_checks()
    if "gradient" in which:
        result["gradient"] = gradient_checks()
    if "raw_key_gradient" in which:
        result["raw_key_gradient"] = raw_key_gradient_checks()
    if "logprob" in which:
        result["logprob"] = logprob_checks()
    if "decode" in which:
        result["decode"] = decode_checks()
    if "candidates" in which:
        result["candidates"] = candidate_checks()
    print(json.dumps(result))
