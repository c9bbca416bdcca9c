"""fla_cpu's ops give the same bits whatever the strides of their inputs (fla_cpu/dispatch.py makes them
contiguous, as fla's input_guard does for its kernels). Without it, CCQ's read at lambda = 0, whose q~
is a fresh tensor, would differ from fla's read of a strided view in the last bits."""

import pytest
import torch
import torch.nn.functional as F

from ccq_eval.model import fla_cpu

B, H, K = 1, 2, 32


def _channel_major(T: int, width: int, seed: int) -> torch.Tensor:
    """[B, T, width] with T as the fastest axis: the layout of a short convolution's output."""
    return torch.randn(B, width, T, generator=torch.Generator().manual_seed(seed)).transpose(1, 2)


def _inputs(T: int):
    q, k, v = (x.unflatten(-1, (H, K)) for x in _channel_major(T, 3 * H * K, 0).split(H * K, dim=-1))
    log_decay = F.logsigmoid(_channel_major(T, H * K, 1)).unflatten(-1, (H, K)) / 16
    beta = torch.rand(B, T, H, generator=torch.Generator().manual_seed(2))
    return q, k, v, log_decay, beta


OPS = {
    "chunk_gla": lambda q, k, v, g, beta: fla_cpu.chunk_gla(q=q, k=k, v=v, g=g)[0],
    "fused_recurrent_gla": lambda q, k, v, g, beta: fla_cpu.fused_recurrent_gla(q=q, k=k, v=v, gk=g)[0],
    "chunk_simple_gla": lambda q, k, v, g, beta: fla_cpu.chunk_simple_gla(q=q, k=k, v=v, g=g[..., 0])[0],
    "chunk_gated_delta_rule": lambda q, k, v, g, beta: fla_cpu.chunk_gated_delta_rule(
        q=q, k=k, v=v, g=g[..., 0], beta=beta, use_qk_l2norm_in_kernel=True)[0],
    "fused_recurrent_gated_delta_rule": lambda q, k, v, g, beta: fla_cpu.fused_recurrent_gated_delta_rule(
        q=q, k=k, v=v, g=g[..., 0], beta=beta, use_qk_l2norm_in_kernel=True)[0],
}


@pytest.mark.parametrize("T", [64, 128, 100])  # whole chunks (no padding copy) and a partial one
@pytest.mark.parametrize("name", sorted(OPS))
def test_strided_inputs_give_the_bits_of_contiguous_ones(name, T):
    strided = _inputs(T)
    assert not strided[0].is_contiguous()
    contiguous = [x.contiguous() for x in strided]
    assert torch.equal(OPS[name](*strided), OPS[name](*contiguous))
