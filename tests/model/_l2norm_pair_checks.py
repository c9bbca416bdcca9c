"""Run by tests/model/test_l2norm_pair.py in a subprocess with TRITON_INTERPRET=1, so that the l2norm_pair
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

from ccq_eval.model import fla_cpu  # noqa: E402
from ccq_eval.model.kernels.l2norm_pair import l2norm_pair, uses_kernels  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = [(2, 37, 3, 64), (2, 37, 3, 48), (1, 5, 2, 256)]  # B, T, H, K: K = 48 masked, 10 rows < BLOCK_ROWS


def qk_views(B, T, H, K, dtype, seed):
    """q, k as the model has them: [B, T, H, K] views of one [B, T, 4 H K] convolution output, and that
    base (a leaf). Rows of very different norms, and one row of zeros (y = 0, rstd = 1 / sqrt(eps))."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, T, 4 * H * K, generator=g) * torch.exp(2 * torch.randn(B, T, 1, generator=g))
    base[0, 0, : H * K] = 0
    base = base.to(dtype).requires_grad_(True)
    return base, base[..., : H * K].unflatten(-1, (H, K)), base[..., H * K: 2 * H * K].unflatten(-1, (H, K))


def max_abs(a, b):
    return (a.double() - b.double()).abs().max().item()


def bf16_ulps(a, b):
    """The largest distance, in bf16 units in the last place, between two bf16 tensors."""
    def ordered(x):
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -32768 - bits, bits)
    return (ordered(a) - ordered(b)).abs().max().item()


def forward_checks():
    out = {}
    for B, T, H, K in CASES:
        for name, dtype in DTYPES.items():
            _, q, k = qk_views(B, T, H, K, dtype, seed=K)
            assert uses_kernels(q)
            yq, yk = l2norm_pair(q, k)
            refs = fla_cpu.torch_l2norm(q), fla_cpu.torch_l2norm(k)
            error = (max(bf16_ulps(y, r) for y, r in zip((yq, yk), refs)) if dtype == torch.bfloat16
                     else max(max_abs(y, r) for y, r in zip((yq, yk), refs)))
            out[f"B{B}_T{T}_H{H}_K{K}_{name}"] = {
                "error": error,
                "contiguous": yq.is_contiguous() and yk.is_contiguous(),
                "dtype": str(yq.dtype) == str(dtype) and str(yk.dtype) == str(dtype),
                "shape": list(yq.shape) == list(q.shape) == list(yk.shape),
            }
    # Other layouts: q contiguous and k strided; a last dim of stride != 1 (copied first); 3-d inputs.
    _, q, k = qk_views(2, 9, 2, 64, torch.float32, seed=1)
    cases = {"mixed_strides": (q.contiguous(), k), "transposed": (q.transpose(-1, -2), k.transpose(-1, -2)),
             "three_dims": (q[0], k[0])}
    for name, (a, b) in cases.items():
        ya, yb = l2norm_pair(a, b)
        out[name] = max(max_abs(ya, fla_cpu.torch_l2norm(a)), max_abs(yb, fla_cpu.torch_l2norm(b)))
    return out


def gradient_checks():
    """Gradients of a random weighted sum of both outputs w.r.t. the base tensor the views come from,
    against autograd through fla_cpu.torch_l2norm in fp64: max |error| / max |reference|."""
    out = {}
    for B, T, H, K in CASES:
        for name, dtype in DTYPES.items():
            base, q, k = qk_views(B, T, H, K, dtype, seed=K + 1)
            g = torch.Generator().manual_seed(K)
            w = torch.randn(2, B, T, H, K, generator=g).to(dtype)  # dy as autograd hands it: input dtype
            yq, yk = l2norm_pair(q, k)
            (grad,) = torch.autograd.grad((yq * w[0]).sum() + (yk * w[1]).sum(), base)
            base64 = base.detach().double().requires_grad_(True)
            q64, k64 = base64[..., : H * K].unflatten(-1, (H, K)), base64[..., H * K: 2 * H * K].unflatten(-1, (H, K))
            loss = (fla_cpu.torch_l2norm(q64) * w[0].double()).sum() + (fla_cpu.torch_l2norm(k64) * w[1].double()).sum()
            (ref,) = torch.autograd.grad(loss, base64)
            out[f"B{B}_T{T}_H{H}_K{K}_{name}"] = {
                "relative": max_abs(grad, ref) / ref.abs().max().item(),
                "dtype": str(grad.dtype) == str(dtype),
                "v_untouched": bool((grad[..., 2 * H * K:] == 0).all()),  # the v channels get nothing
            }
    # Only q's output used: k's gradient is exactly zero.
    base, q, k = qk_views(1, 7, 2, 64, torch.float32, seed=3)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    (grad,) = torch.autograd.grad((l2norm_pair(q, k)[0] * w).sum(), base)
    (ref,) = torch.autograd.grad((fla_cpu.torch_l2norm(q) * w).sum(), base)
    out["q_only"] = {"relative": max_abs(grad, ref) / ref.abs().max().item(),
                     "k_zero": bool((grad[..., 128:] == 0).all())}
    return out


if __name__ == "__main__":
    checks = {"forward": forward_checks, "gradient": gradient_checks}
    which = sys.argv[1]
    print(json.dumps({which: checks[which]()}))
