"""The fused Triton CCQ read (ccq_eval/model/kernels/ccq_*.py) against the O(T^2) reference.

On CPU the kernels run in Triton's interpreter, which must be switched on before triton compiles
anything, so the checks run in one subprocess (tests/model/_triton_interpreter_checks.py). On a GPU the
compiled kernels are checked directly, in bf16 and fp32, at 4K tokens.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ccq_eval.model.ccq import CCQState, ccq_read_chunk, ccq_read_reference, unit_keys

CHECKS = Path(__file__).with_name("_triton_interpreter_checks.py")


@pytest.fixture
def fused(monkeypatch):
    """The fused kernels are the default; this holds them on whatever the environment says."""
    monkeypatch.setenv("CCQ_EVAL_CCQ_KERNEL", "fused")
    monkeypatch.setenv("CCQ_EVAL_TOKEN_LOGPROB", "triton")


# The interpreter check each test reads (an argument of _triton_interpreter_checks.py).
CHECK_OF_TEST = {
    "test_fused_forward_matches_reference_in_interpreter": "forward",
    "test_fused_gradients_match_reference_in_interpreter": "gradient",
    "test_training_on_raw_keys_matches_reference_in_interpreter": "raw_key_gradient",
    "test_fused_decode_step_matches_recurrence_in_interpreter": "decode",
    "test_token_logprob_kernel_matches_torch_in_interpreter": "logprob",
    "test_every_autotune_candidate_is_correct_and_in_bounds_in_interpreter": "candidates",
}


@pytest.fixture(scope="module")
def interpreter_results(request) -> dict:
    """The checks of this module's selected tests, run in one subprocess (one start of torch and triton)."""
    selected = [CHECK_OF_TEST[item.name] for item in request.session.items
                if item.path == request.path and item.name in CHECK_OF_TEST]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # No time limit: the interpreter's run time follows the machine's speed, and a slow machine is no
    # failure; CI's job limit ends a hang.
    done = subprocess.run([sys.executable, str(CHECKS), *selected], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def interpreter(request, interpreter_results) -> dict:
    """The result of the calling test's own check."""
    return interpreter_results[CHECK_OF_TEST[request.node.name]]


@pytest.mark.slow  # the triton interpreter runs every shape of the fused forward on the CPU
def test_fused_forward_matches_reference_in_interpreter(interpreter):
    result = interpreter
    for name, errors in result.items():
        if isinstance(errors, dict):  # fp32 inputs, exact-precision dots: fp32 rounding only
            assert errors["q"] < 1e-5, (name, errors)
            assert errors["state"] < 1e-5, (name, errors)
    assert result["fp16_relative_l2"] < 2e-3
    assert result["lambda0_identical"]
    assert result["batch_rows_equal_single_rows"]


@pytest.mark.slow  # the triton interpreter runs the fused backward on the CPU
def test_fused_gradients_match_reference_in_interpreter(interpreter):
    for name, relative in interpreter.items():
        assert relative < 1e-5, (name, relative)


@pytest.mark.slow  # the triton interpreter runs the fused training path on the CPU
def test_training_on_raw_keys_matches_reference_in_interpreter(interpreter):
    """The training path of the layers on CUDA (_FusedOrder1Keys: keys normalised and lambda formed in
    the kernels, their chain rules in the backward): every gradient, the gate's included, against
    autograd in fp64; gate parameters in half precision get their gradients in their dtype."""
    result = interpreter
    assert len(result) == 10
    for name, relative in result.items():
        assert relative < 1e-5, (name, relative)


def _gpu_inputs(T, H, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(1, T, H, K, generator=g)
    kappa = unit_keys(torch.randn(1, T, H, K, generator=g))
    log_gamma = torch.nn.functional.logsigmoid(torch.randn(1, T, H, generator=g) + 4)
    lam = 4 * torch.rand(1, T, H, generator=g)
    return r.to(dtype), kappa.to(dtype), log_gamma, lam


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("K,T", [(128, 4000), (128, 4096), (256, 4096)])
def test_fused_cuda_matches_reference(dtype, tolerance, K, T, fused):
    """q~ and the final state at about 4K tokens (with a ragged last chunk, then whole chunks;
    GLA-340M's 128, Gated DeltaNet-340M's 256)."""
    r, kappa, log_gamma, lam = _gpu_inputs(T, 2, K, dtype)
    state = ccq_read_reference(*(x.double() for x in _gpu_inputs(50, 2, K, torch.float32, seed=1)))[1]
    q_ref, s_ref = ccq_read_chunk(r.double(), kappa.double(), log_gamma.double(), lam.double(), 1, True, state)
    with torch.no_grad():
        q, s = ccq_read_chunk(*(x.cuda() for x in (r, kappa, log_gamma, lam)), 1, True,
                              CCQState(*(x.float().cuda() for x in state)))
    relative = ((q.cpu().double() - q_ref).norm() / q_ref.norm()).item()
    print(f"{dtype} K={K}: relative L2 error of q~ = {relative:.2e}")
    assert relative < tolerance
    for a, b in zip(s, s_ref):
        assert ((a.cpu().double() - b).norm() / b.norm()).item() < tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K,dtype,tolerance", [(128, torch.float32, 1e-3), (256, torch.float32, 1e-3),
                                               (128, torch.bfloat16, 5e-2)])
def test_fused_cuda_gradients_match_reference(K, dtype, tolerance, fused):
    """The Triton backward on CUDA vs autograd through the chunk form in fp64 on CPU (T = 2000: a
    ragged last chunk). (Not the unfused CUDA path: fla's fp32 kernels multiply in tf32.)"""
    r, kappa, log_gamma, lam = _gpu_inputs(2000, 2, K, torch.float32)
    weights = torch.randn(r.shape)

    def grads(device, dtype):
        leaves = [x.to(device, dtype if x.dim() == 4 else x.dtype).requires_grad_(True)
                  for x in (r, kappa, log_gamma, lam)]
        if device == "cpu":
            leaves = [x.detach().double().requires_grad_(True) for x in leaves]
        q, _ = ccq_read_chunk(*leaves, 1, True)
        return torch.autograd.grad((q.double() * weights.to(device).double()).sum(), leaves)

    for name, a, b in zip(("r", "kappa", "log_gamma", "lam"), grads("cuda", dtype), grads("cpu", torch.float64)):
        relative = ((a.cpu().double() - b).norm() / b.norm()).item()
        print(f"K={K} {dtype} d{name}: relative L2 error vs fp64 = {relative:.2e}")
        assert relative < tolerance


@pytest.mark.slow  # triton's interpreter
def test_fused_decode_step_matches_recurrence_in_interpreter(interpreter):
    for name, errors in interpreter.items():  # five steps from a prior state, fp32
        assert errors["q"] < 1e-5, (name, errors)
        assert errors["state"] < 1e-5, (name, errors)


@pytest.mark.slow  # triton's interpreter
def test_token_logprob_kernel_matches_torch_in_interpreter(interpreter):
    for name, result in interpreter.items():
        assert result["max_abs_logprob"] < 1e-5, (name, result)
        assert result["greedy_equal"], (name, result)
        assert result["greedy_count"] == 6, (name, result)  # 5 greedy targets + the cross-block tie


@pytest.mark.slow  # minutes: every autotune candidate of every kernel in the triton interpreter
def test_every_autotune_candidate_is_correct_and_in_bounds_in_interpreter(interpreter):
    """Each autotune candidate of every kernel (a GPU's autotuner may pick any), at head dims 64 and
    128, whole and ragged last chunks, several batches and heads: values against fp64, and every load
    and store inside its tensors (tests/model/_triton_bounds.py; all interpreter checks run under it). The
    bounds check itself must catch a planted overrun."""
    result = interpreter
    assert result["overrun_caught"]
    # Every distinct candidate of every kernel (by its constexprs) ran: the read kernel's 4, at 4 shapes each.
    assert result["ran"] == result["candidates"], result
    assert result["runs"]["forward"] >= 4 and len(result["errors"]) % 4 == 0, result
    assert sum(e["forward"] is not None for e in result["errors"].values()) == 4 * result["runs"]["forward"]
    assert sum(e["decode"] is not None for e in result["errors"].values()) == 4  # the step has no candidates
    for name, errors in result["errors"].items():
        half = "float16" in name
        assert errors["forward"] is None or errors["forward"] < (2e-3 if half else 1e-5), (name, errors)
        assert errors["decode"] is None or errors["decode"] < (2e-3 if half else 1e-5), (name, errors)
        assert half or "backward" not in errors["paths"] or errors["backward"] < 1e-5, (name, errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_token_logprob_cuda_bf16_matches_fp32_torch(fused):
    from ccq_eval.model.kernels.token_logprob import token_logprob

    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(2, 300, 32000, generator=g)).bfloat16()
    targets = torch.randint(0, 32000, (2, 300), generator=g)
    targets[:, :50] = logits[:, :50].float().argmax(-1)
    ref_lp, ref_greedy = token_logprob(logits.float(), targets)  # CPU: torch in fp32
    lp, greedy = token_logprob(logits.cuda(), targets.cuda())
    assert (lp.cpu() - ref_lp).abs().max().item() < 1e-4
    assert torch.equal(greedy.cpu(), ref_greedy)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("constant_gate", [False, True])
def test_layer_entry_fused_matches_fp64_on_cuda(constant_gate, fused):
    """ccq_read_keys (what the layers call): keys normalised and lambda formed inside the kernels, fp32
    on CUDA, vs unit_keys + the gate in torch in fp64 on CPU; a prefill continuing from a state, then
    one decoding step from the prefill's state."""
    from ccq_eval.model.ccq import CCQGate, ccq_read_keys

    g = torch.Generator().manual_seed(3)
    r = torch.randn(1, 3000, 2, 128, generator=g)
    k = 3 * torch.randn(1, 3000, 2, 128, generator=g)
    log_gamma = torch.nn.functional.logsigmoid(torch.randn(1, 3000, 2, generator=g) + 4)
    weight = None if constant_gate else 0.2 * torch.randn(2, 128, generator=g)
    bias = torch.randn(2, generator=g)
    state = ccq_read_reference(*(x.double() for x in _gpu_inputs(40, 2, 128, torch.float32, seed=5)))[1]
    outputs = {}
    for device, dtype in (("cuda", torch.float32), ("cpu", torch.float64)):
        def on(x):
            return None if x is None else x.to(device, dtype)  # noqa: B023 (called within this iteration)

        gate = CCQGate(on(weight), on(bias), 4.0)
        with torch.no_grad():
            q, after_prefill = ccq_read_keys(on(r), on(k), on(log_gamma), gate,
                                             initial_state=CCQState(*(on(x) for x in state)))
            q_step, after_step = ccq_read_keys(on(r[:, :1]), on(k[:, -1:]), on(log_gamma[:, :1]), gate,
                                               initial_state=after_prefill)
        outputs[device] = [q, *after_prefill, q_step, *after_step]
    for a, b in zip(outputs["cuda"], outputs["cpu"]):
        assert ((a.cpu().double() - b).norm() / b.norm()).item() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K", [128, 256])
def test_keys_unit_takes_the_keys_as_kappa_on_cuda(K, fused):
    """keys_unit=True (Gated DeltaNet's already-normalised keys): the fused prefill reads k as kappa.
    Unit keys give the normalising path's q~ and state; keys of length 2 give the fp64 reference read
    with kappa = k, unnormalised (so a flag that were ignored fails here)."""
    from ccq_eval.model.ccq import CCQGate, ccq_read_chunk, ccq_read_keys

    r, k, log_gamma, _ = _gpu_inputs(2000, 2, K, torch.float32, seed=31)
    unit = torch.nn.functional.normalize(k, dim=-1)
    gate = CCQGate(None, torch.zeros(2), 4.0)
    lam = gate.values(r).double()
    on_gpu = CCQGate(None, gate.bias.cuda(), 4.0)
    with torch.no_grad():
        q_given, state_given = ccq_read_keys(r.cuda(), unit.cuda(), log_gamma.cuda(), on_gpu, keys_unit=True)
        q_normed, state_normed = ccq_read_keys(r.cuda(), unit.cuda(), log_gamma.cuda(), on_gpu)
        q_long, _ = ccq_read_keys(r.cuda(), 2 * unit.cuda(), log_gamma.cuda(), on_gpu, keys_unit=True)
    q_ref, _ = ccq_read_chunk(r.double(), 2 * unit.double(), log_gamma.double(), lam)
    for a, b in zip([q_given, *state_given], [q_normed, *state_normed]):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    assert ((q_long.cpu().double() - q_ref).norm() / q_ref.norm()).item() < 1e-4


@pytest.fixture
def one_candidate_at_a_time():
    """Yields a function that restricts every autotuned fused kernel to its i-th candidate (the last
    one for kernels with fewer); the autotuners' configs and caches are restored afterwards."""
    from triton.runtime.autotuner import Autotuner

    from ccq_eval.model.kernels import ccq_backward, ccq_decode, ccq_forward

    tuned = [k for m in (ccq_forward, ccq_backward, ccq_decode) for k in vars(m).values()
             if isinstance(k, Autotuner)]
    saved = [(k, k.configs, dict(k.cache)) for k in tuned]

    def select(i):
        for kernel, configs, _ in saved:
            kernel.configs = [configs[min(i, len(configs) - 1)]]
            kernel.cache.clear()
        return max(len(configs) for _, configs, _ in saved)

    yield select
    for kernel, configs, cache in saved:
        kernel.configs = configs
        kernel.cache.clear()
        kernel.cache.update(cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K", [128, 256])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_training_on_raw_keys_matches_fp64_on_cuda(K, dtype, tolerance, fused):
    """What the layers' training calls on CUDA (ccq_read_keys with gradients: _FusedOrder1Keys, the gate
    parameters in the model's dtype): every gradient against autograd through unit_keys, the gate and
    the reference in fp64 on CPU."""
    from ccq_eval.model.ccq import CCQGate, ccq_read_keys

    r, _, log_gamma, _ = _gpu_inputs(1000, 2, K, torch.float32, seed=21)
    g = torch.Generator().manual_seed(22)
    k = 3 * torch.randn(r.shape, generator=g)
    weight, bias = 0.2 * torch.randn(2, K, generator=g), torch.randn(2, generator=g)
    weights = torch.randn(r.shape, generator=g)
    leaves = [x.double().requires_grad_(True) for x in (r, k, log_gamma, weight, bias)]
    q_ref, _ = ccq_read_keys(*leaves[:3], CCQGate(leaves[3], leaves[4], 4.0))
    ref = torch.autograd.grad((q_ref * weights.double()).sum(), leaves)
    leaves = [x.to("cuda", dtype if i != 2 else torch.float32).requires_grad_(True)
              for i, x in enumerate((r, k, log_gamma, weight, bias))]
    q, _ = ccq_read_keys(*leaves[:3], CCQGate(leaves[3], leaves[4], 4.0))
    got = torch.autograd.grad((q.float() * weights.cuda()).sum(), leaves)
    for name, a, b, leaf in zip(("r", "k", "log_gamma", "gate_weight", "gate_bias"), got, ref, leaves):
        assert a.dtype == leaf.dtype
        relative = ((a.cpu().double() - b).norm() / b.norm()).item()
        print(f"{dtype} K={K} d{name}: relative L2 error {relative:.2e}")
        assert relative < tolerance, (name, relative)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K", [128, 256])
def test_every_autotune_candidate_matches_fp64_on_cuda(K, fused, one_candidate_at_a_time):
    """The autotuner may pick any candidate, and the other GPU tests run with whichever it picked
    (one): here each candidate of every kernel in turn, forward
    (raw keys, gate, prior state) and the backward, in fp32 and bf16, against fp64 on CPU. (An illegal
    memory access of one bf16 candidate surfaces as a CUDA error: the printed index names it.)"""
    from ccq_eval.model.ccq import CCQGate, ccq_read_keys

    r, kappa, log_gamma, lam = _gpu_inputs(1000, 2, K, torch.float32, seed=9)
    k = 3 * kappa
    g = torch.Generator().manual_seed(10)
    weight, bias = 0.2 * torch.randn(2, K, generator=g), torch.randn(2, generator=g)
    state = ccq_read_reference(*(x.double() for x in _gpu_inputs(40, 2, K, torch.float32, seed=11)))[1]
    with torch.no_grad():
        q_ref, _ = ccq_read_keys(r.double(), k.double(), log_gamma.double(),
                                 CCQGate(weight.double(), bias.double(), 4.0), initial_state=CCQState(*state))
    weights = torch.randn(r.shape, generator=g)
    leaves = [x.double().requires_grad_(True) for x in (r, kappa, log_gamma, lam)]
    grads_ref = torch.autograd.grad((ccq_read_chunk(*leaves, 1, True)[0] * weights.double()).sum(), leaves)

    n_candidates = one_candidate_at_a_time(0)
    for i in range(n_candidates):
        one_candidate_at_a_time(i)
        for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
            gate = CCQGate(weight.cuda(), bias.cuda(), 4.0)
            with torch.no_grad():
                q, _ = ccq_read_keys(r.to("cuda", dtype), k.to("cuda", dtype), log_gamma.cuda(), gate,
                                     initial_state=CCQState(*(x.float().cuda() for x in state)))
            relative = ((q.cpu().double() - q_ref).norm() / q_ref.norm()).item()
            assert relative < tolerance, (i, dtype, relative)
        for dtype, tolerance in ((torch.float32, 1e-3), (torch.bfloat16, 5e-2)):
            print(f"candidate {i}: backward in {dtype}", flush=True)
            leaves = [x.to("cuda", dtype if x.dim() == 4 else x.dtype).requires_grad_(True)
                      for x in (r, kappa, log_gamma, lam)]
            q = ccq_read_chunk(*leaves, 1, True)[0]
            grads = torch.autograd.grad((q.float() * weights.cuda()).sum(), leaves)
            torch.cuda.synchronize()
            for name, a, b in zip(("r", "kappa", "log_gamma", "lam"), grads, grads_ref):
                relative = ((a.cpu().double() - b).norm() / b.norm()).item()
                assert relative < tolerance, (i, dtype, name, relative)
