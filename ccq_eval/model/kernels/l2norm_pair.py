"""L2 normalisation of q and k together, read straight from their strided views (Triton, CUDA).

Why: in `CCQGatedDeltaNet.forward` q and k are [B, T, H, K] views of one short convolution's output
over the q|k|v channels (`short_conv_qkv`): the last dim is contiguous, the T stride is the whole
q|k|v width. `fla_cpu.l2norm(torch.stack([q, k]))` first copies both into a contiguous stack, which
costs several times what the normalisation itself moves. Here one kernel launch reads both views and
writes both results, contiguous, into one [2, B, T, H, K] tensor; one more launch is the backward.

Numerics are fla's l2norm (fla/modules/norm/l2norm.py): fp32 compute, rstd = 1 / sqrt(sum(x^2) + eps),
y = x * rstd written in the input dtype; the backward dx = dy * rstd - sum(dy * y) * y * rstd from the
saved y (input dtype) and rstd (fp32), dx in the input dtype.

On CPU, and for fp64 anywhere (fp64 arithmetic, not the kernels' fp32), `l2norm_pair` is the torch
path `fla_cpu.torch_l2norm(torch.stack([q, k]))`, bit for bit. With
TRITON_INTERPRET=1 (set before this module is imported) the kernels run on CPU tensors instead, which
is how tests/model/test_l2norm_pair.py checks them without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ccq_eval.model import fla_cpu
from ccq_eval.model.kernels.triton_device import on_device_of

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Elements per program: BLOCK_ROWS = TILE // next_power_of_2(K) rows (16 at K = 256), 4 warps.
TILE = 4096


@triton.jit
def _l2norm_pair_fwd_kernel(q, k, y, rstd, q_sb, q_st, q_sh, k_sb, k_st, k_sh, T, H, N, eps,
                            K: tl.constexpr, BD: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Grid (cdiv(N, BLOCK_ROWS), 2): axis 1 picks q or k, [B, T, H, K] with strides (sb, st, sh, 1);
    y [2, N, K] and rstd [2, N] are contiguous. N = B * T * H rows per input."""
    which = tl.program_id(1)
    if which == 0:
        x, sb, st, sh = q, q_sb, q_st, q_sh
    else:
        x, sb, st, sh = k, k_sb, k_st, k_sh
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BD)
    row_ok = rows < N
    mask = row_ok[:, None] & (cols < K)[None, :]
    bt = rows // H  # row -> (b, t, h) of the input's layout
    b = bt // T
    t, h = bt - b * T, rows - bt * H
    b_x = tl.load(x + (b * sb + t * st + h * sh)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)  # fla's expression
    out_rows = which.to(tl.int64) * N + rows
    p_y = y + out_rows[:, None] * K + cols[None, :]
    tl.store(p_y, (b_x * b_rstd[:, None]).to(p_y.dtype.element_ty), mask=mask)
    tl.store(rstd + out_rows, b_rstd, mask=row_ok)


@triton.jit
def _l2norm_pair_bwd_kernel(y, rstd, dy, dx, M, K: tl.constexpr, BD: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Grid (cdiv(M, BLOCK_ROWS),) over the M = 2 N rows of q and k: y, dy, dx [M, K] and rstd [M],
    all contiguous. dx = dy * rstd - sum(dy * y) * y * rstd (fla's l2norm_bwd)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BD)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    offsets = rows[:, None] * K + cols[None, :]
    b_y = tl.load(y + offsets, mask=mask, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + offsets, mask=mask, other=0.0).to(tl.float32)
    b_rstd = tl.load(rstd + rows, mask=row_ok, other=0.0)
    b_dx = b_dy * b_rstd[:, None] - tl.sum(b_dy * b_y, 1)[:, None] * b_y * b_rstd[:, None]
    tl.store(dx + offsets, b_dx.to(dx.dtype.element_ty), mask=mask)


def _launch_shape(K: int) -> tuple[int, int, int]:
    """(BD, BLOCK_ROWS, num_warps): about TILE elements per program, 4 warps for TILE, more for wide rows."""
    BD = triton.next_power_of_2(K)
    block_rows = max(1, TILE // BD)
    return BD, block_rows, min(16, max(4, block_rows * BD // 1024))


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a [B, T, H, K] view whose last dim has stride 1 (a copy only where that cannot be)."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()  # e.g. a channels-first convolution's output: correct, not fast
    while x.dim() < 4:
        x = x.unsqueeze(0)
    if x.dim() > 4:
        x = x.flatten(0, x.dim() - 4)  # a view where the leading dims allow it
    return x


def _l2norm_pair_fwd(q: torch.Tensor, k: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y [2, *q.shape] in q's dtype (y[0] = l2norm(q), y[1] = l2norm(k)) and rstd [2, rows] in fp32."""
    y = torch.empty((2, *q.shape), device=q.device, dtype=q.dtype)
    q4, k4 = _as_rows(q), _as_rows(k)
    B, T, H, K = q4.shape
    N = B * T * H
    rstd = torch.empty((2, N), device=q.device, dtype=torch.float32)
    if y.numel():
        BD, block_rows, num_warps = _launch_shape(K)
        with on_device_of(q):
            _l2norm_pair_fwd_kernel[(triton.cdiv(N, block_rows), 2)](
                q4, k4, y, rstd, *q4.stride()[:3], *k4.stride()[:3], T, H, N, eps,
                K=K, BD=BD, BLOCK_ROWS=block_rows, num_warps=num_warps)
    return y, rstd


def _l2norm_pair_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    dy = dy.contiguous()  # unbind's backward stacks the two gradients: already contiguous
    dx = torch.empty_like(y)
    if y.numel():
        K = y.shape[-1]
        M = rstd.numel()
        BD, block_rows, num_warps = _launch_shape(K)
        with on_device_of(y):
            _l2norm_pair_bwd_kernel[(triton.cdiv(M, block_rows),)](
                y, rstd, dy, dx, M, K=K, BD=BD, BLOCK_ROWS=block_rows, num_warps=num_warps)
    return dx


class _L2NormPair(torch.autograd.Function):
    """(q, k) -> y [2, *q.shape]; the backward returns contiguous gradients for the (strided) inputs."""

    @staticmethod
    def forward(ctx, q, k, eps):
        y, rstd = _l2norm_pair_fwd(q, k, eps)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        dx = _l2norm_pair_bwd(y, rstd, dy)
        return dx[0], dx[1], None


def uses_kernels(x: torch.Tensor) -> bool:
    """Whether `l2norm_pair` runs the Triton kernels for x: CUDA (or CPU under TRITON_INTERPRET=1), not
    fp64 (fp64 keeps the torch path and its fp64 arithmetic)."""
    return (x.is_cuda or (_INTERPRET and x.device.type == "cpu")) and x.dtype != torch.float64


def l2norm_pair(q: torch.Tensor, k: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(l2norm(q), l2norm(k)) over the last dim, fla's definition, each contiguous (views into one
    [2, *q.shape] tensor). q and k: the same shape, dtype and device, any strides (fast when the last
    dim has stride 1); differentiable."""
    if q.shape != k.shape or q.dtype != k.dtype or q.device != k.device:
        raise ValueError(
            "l2norm_pair needs q and k of the same shape, dtype and device; got "
            f"{tuple(q.shape)} {q.dtype} {q.device} and {tuple(k.shape)} {k.dtype} {k.device}")
    if not q.is_floating_point() or q.dim() == 0:
        raise ValueError(f"l2norm_pair needs floating-point inputs with a last dim, got {q.dtype} {tuple(q.shape)}")
    if not uses_kernels(q):
        # Today's CPU path, bit for bit (the CPU model tests' numbers).
        return fla_cpu.torch_l2norm(torch.stack([q, k]), eps).unbind(0)
    return _L2NormPair.apply(q, k, eps).unbind(0)
