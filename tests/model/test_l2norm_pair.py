"""ccq_eval/model/kernels/l2norm_pair.py: q and k L2-normalised from their strided views, against fla_cpu.torch_l2norm.

On CPU the kernels run in Triton's interpreter, which must be switched on before triton compiles
anything, so those checks run in a subprocess (tests/model/_l2norm_pair_checks.py, under the interpreter
bounds check of tests/model/_triton_bounds.py). Without the interpreter the CPU path is today's torch code,
checked bit for bit. On a GPU the compiled kernels are checked directly at Gated DeltaNet 340M's shape.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ccq_eval.model import fla_cpu
from ccq_eval.model.kernels.l2norm_pair import l2norm_pair, uses_kernels

CHECKS = Path(__file__).with_name("_l2norm_pair_checks.py")


def _interpreter(which: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # No time limit: the interpreter's run time follows the machine's speed; CI's job limit ends a hang.
    done = subprocess.run([sys.executable, str(CHECKS), which], env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])[which]


def _qk_views(B, T, H, K, dtype, device="cpu", seed=0):
    """q, k as CCQGatedDeltaNet has them: [B, T, H, K] views of one [B, T, 4 H K] q|k|v tensor (a leaf)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, T, 4 * H * K, generator=g).to(device, dtype).requires_grad_(True)
    return base, base[..., : H * K].unflatten(-1, (H, K)), base[..., H * K: 2 * H * K].unflatten(-1, (H, K))


def test_kernels_match_torch_l2norm_in_interpreter():
    """fp32: max |y - torch_l2norm| < 1e-6 (fp32 rounding; |y| <= 1); bf16: at most one bf16 ulp apart.
    Outputs contiguous, in the input dtype; K = 48 (masked columns), 10 rows in a 16-row block, a zero
    row, q contiguous with k strided, a last dim of stride != 1 and 3-d inputs."""
    result = _interpreter("forward")
    assert len(result) == 9
    for name, errors in result.items():
        if isinstance(errors, float):
            assert errors < 1e-6, (name, errors)
            continue
        assert errors["contiguous"] and errors["dtype"] and errors["shape"], (name, errors)
        assert errors["error"] <= (1 if name.endswith("bf16") else 1e-6), (name, errors)


def test_kernel_gradients_match_fp64_autograd_in_interpreter():
    """d(sum w * y) / d(base) through the strided views, against autograd through torch_l2norm in fp64:
    max |error| / max |reference| < 1e-6 in fp32, < 2e-2 in bf16 (y and dx are rounded to bf16, as in
    fla's backward; measured 4e-3 to 6e-3). The v channels of the base get exactly zero."""
    result = _interpreter("gradient")
    assert len(result) == 7
    q_only = result.pop("q_only")
    assert q_only["k_zero"] and q_only["relative"] < 1e-6, q_only
    for name, errors in result.items():
        assert errors["dtype"] and errors["v_untouched"], (name, errors)
        assert errors["relative"] < (2e-2 if name.endswith("bf16") else 1e-6), (name, errors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_is_todays_stacked_l2norm_bit_for_bit(dtype):
    if uses_kernels(torch.empty(0)):
        pytest.skip("TRITON_INTERPRET=1: CPU tensors go to the kernels")
    base, q, k = _qk_views(2, 37, 3, 64, dtype)
    outputs = l2norm_pair(q, k)
    expected = fla_cpu.torch_l2norm(torch.stack([q, k])).unbind(0)
    for y, ref in zip(outputs, expected):
        assert torch.equal(y, ref) and y.is_contiguous()
    w = torch.randn(2, 2, 37, 3, 64).to(dtype)
    grads = [torch.autograd.grad((ys[0] * w[0]).sum() + (ys[1] * w[1]).sum(), base)[0]
             for ys in (outputs, expected)]
    assert torch.equal(*grads)


def test_rejects_mismatched_inputs():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="same shape"):
        l2norm_pair(q, torch.randn(1, 4, 2, 16))
    with pytest.raises(ValueError, match="same shape"):
        l2norm_pair(q, q.to(torch.bfloat16))


def _bf16_ulps(a, b):
    """The largest distance between two bf16 tensors in bf16 units in the last place."""
    def ordered(x):
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -32768 - bits, bits)
    return (ordered(a) - ordered(b)).abs().max().item()


def _forward_error(y, ref):
    """bf16: ulps apart; fp32: max abs difference."""
    if y.dtype == torch.bfloat16:
        return _bf16_ulps(y, ref)
    return (y.double() - ref.double()).abs().max().item()


def _check_against_reference(device, dtype, T=4096, H=4, K=256):
    """Forward and backward of l2norm_pair on `device` against torch_l2norm (fp32 compute) and, for the
    gradients, fp64 autograd; on CUDA also against fla's l2norm of the stack (the path it replaces).
    Forward: one bf16 ulp, 2e-6 in fp32 (CUDA's sqrt and division are not correctly rounded);
    gradients: max |error| / max |reference| < 2e-2 in bf16, 1e-5 in fp32."""
    base, q, k = _qk_views(1, T, H, K, dtype, device)
    w = torch.randn(2, 1, T, H, K, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    yq, yk = l2norm_pair(q, k)
    assert yq.is_contiguous() and yk.is_contiguous() and yq.dtype == yk.dtype == dtype
    forward_tolerance = 1 if dtype == torch.bfloat16 else 2e-6
    for y, x in ((yq, q), (yk, k)):
        assert _forward_error(y, fla_cpu.torch_l2norm(x)) <= forward_tolerance
    (grad,) = torch.autograd.grad((yq * w[0]).sum() + (yk * w[1]).sum(), base)
    base64 = base.detach().double().requires_grad_(True)
    q64, k64 = base64[..., : H * K].unflatten(-1, (H, K)), base64[..., H * K: 2 * H * K].unflatten(-1, (H, K))
    (ref,) = torch.autograd.grad((fla_cpu.torch_l2norm(q64) * w[0].double()).sum()
                                 + (fla_cpu.torch_l2norm(k64) * w[1].double()).sum(), base64)
    gradient_tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    relative = ((grad.double() - ref).abs().max() / ref.abs().max()).item()
    assert relative < gradient_tolerance, relative
    assert (grad[..., 2 * H * K:] == 0).all()
    if device == "cuda":  # the same formulas as fla's kernels: closer still
        from fla.modules.norm.l2norm import l2norm as fla_l2norm

        fla_y = fla_l2norm(torch.stack([q, k]))
        for y, ref_y in zip((yq, yk), fla_y.unbind(0)):
            assert _forward_error(y, ref_y) <= forward_tolerance
        (fla_grad,) = torch.autograd.grad((fla_y * w).sum(), base)
        relative = ((grad.double() - fla_grad.double()).abs().max() / fla_grad.double().abs().max()).item()
        assert relative < gradient_tolerance, relative


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels_match_reference_at_340m_shape(dtype):
    _check_against_reference("cuda", dtype)
