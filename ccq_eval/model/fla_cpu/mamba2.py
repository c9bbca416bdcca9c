"""Torch versions of fla's ops for the mamba2 layers (fla 0.6).

- Mamba2 (fla.layers.mamba2): a whole torch forward. fla's own torch path (used off CUDA) casts x, B and C to
  float32 (so a float64 model is not computed in float64) and builds [B, T, chunk, chunk, H, N] tensors. The SSD
  recurrence h_t = exp(dt_t A_h) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t is simple GLA with q = C, k = B,
  v = dt x, per-step log decay dt A and scale 1, so it runs on the simple-GLA torch ops (chunkwise, states
  [N, H, head_dim, state_size] as fla's cache holds them). Control flow and cache contents are fla's: a prefill
  starts from a zero state, a call with a cached state takes exactly one token (ValueError otherwise, as fla).
- rmsnorm_fn / layernorm_fn (fla.modules.layernorm_gated, used by RMSNormGated / LayerNormGated): group norm
  with an optional SiLU gate applied before or after the normalisation.

OPS: fla op name -> FlaOp (merged into dispatch.OPS; a layer whose code looks the name up gets the
dispatcher bound in its place). MODULE_FORWARDS: "fla.module.path:Class" -> (torch forward, name of the
tensor argument that decides the device, whether CUDA calls take the torch forward too) (merged into the
backend's module table). Mamba2 on CUDA takes it where fla lacks mamba_ssm's kernels: fla's fallback there
is the torch path above, whose [B, T, chunk, H, head_dim] product needs 17 GB per layer for one 8K row of
a 340M-shape model, where the chunked simple-GLA form runs fla's own chunk_simple_gla kernels (with the
Hopper-safe backward where fla #640 applies).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ccq_eval.model.fla_cpu.common import FlaOp, compute_dtype
from ccq_eval.model.fla_cpu.dqkwg import cuda_op
from ccq_eval.model.fla_cpu.linear_attention import torch_chunk_simple_gla, torch_fused_recurrent_simple_gla
from ccq_eval.model.fla_cpu.modules import torch_causal_conv1d

# --------------------------------------------------------------------------------------------
# gated norms (fla.modules.layernorm_gated)
# --------------------------------------------------------------------------------------------


def torch_layernorm_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
    is_rms_norm: bool = False,
) -> torch.Tensor:
    """LayerNorm (RMSNorm if is_rms_norm) over groups of `group_size` channels (all channels if None), times
    weight plus bias, gated by silu(z): norm(x) * silu(z) if norm_before_gate else norm(x * silu(z)).
    Computed in float32 or wider, returned in x.dtype."""
    D = x.shape[-1]
    group_size = D if group_size is None else group_size
    if D % group_size != 0:
        raise ValueError(f"layernorm_fn: {D} channels do not split into groups of {group_size}.")
    dtype = compute_dtype(x, z)
    gate = F.silu(z.to(dtype)) if z is not None else None
    xf = x.to(dtype)
    if gate is not None and not norm_before_gate:
        xf = xf * gate
    groups = xf.reshape(*xf.shape[:-1], D // group_size, group_size)
    if not is_rms_norm:
        groups = groups - groups.mean(-1, keepdim=True)
    y = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + eps)).reshape(xf.shape)
    y = y * weight.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype)


def torch_rmsnorm_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """The RMSNorm form of torch_layernorm_fn (fla's RMSNormGated)."""
    return torch_layernorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm=True)


# --------------------------------------------------------------------------------------------
# Mamba2 layer
# --------------------------------------------------------------------------------------------


def _heads_of_groups(x: torch.Tensor, num_heads: int, state_size: int) -> torch.Tensor:
    """[B, T, G * N] -> [B, T, H, N]: head h reads group h // (H / G) (mamba_ssm's grouping, and fla's decode)."""
    groups = x.reshape(*x.shape[:2], -1, state_size)
    return groups.repeat_interleave(num_heads // groups.shape[2], dim=2)


def chunk_simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs):
    """fla's chunk_simple_gla kernels on CUDA tensors (forward and backward; on a machine hit by fla #640 the
    same op with the torch chunk_bwd_dqkwg, as dispatch serves it), the torch op elsewhere."""
    if q.is_cuda:
        return cuda_op("chunk_simple_gla")(q, k, v, **kwargs)
    return torch_chunk_simple_gla(q, k, v, **kwargs)


def _mamba2_mix(self, x: torch.Tensor, last_state: dict | None, use_cache: bool, attention_mask: torch.Tensor | None):
    """Mamba2.torch_forward's computation (projection, causal conv, SSD, gated norm, output projection) in float32
    or wider. Returns (output in x.dtype, conv state or None, ssm state [B, H, head_dim, state_size])."""
    batch, seq_len, _ = x.shape
    H, P, N = self.num_heads, self.head_dim, self.ssm_state_size
    projected = self.in_proj(x)
    d_mlp = (projected.shape[-1] - 2 * self.intermediate_size - 2 * self.n_groups * N - H) // 2
    _, _, gate, xBC, dt = projected.split([d_mlp, d_mlp, self.intermediate_size, self.conv_dim, H], dim=-1)
    weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias  # [conv_dim, W]
    dtype = compute_dtype(xBC, weight)
    masked = attention_mask is not None and attention_mask.shape == xBC.shape[:2]

    if last_state is not None:
        if seq_len != 1:
            raise ValueError("Mamba2 cached decoding only supports a single new token per step.")
        ssm_state = last_state["recurrent_state"]
        cache = last_state["conv_state"]  # the last W inputs of the convolution, [B, conv_dim, W]
        window = torch.cat([cache[..., 1:].to(dtype), xBC[:, 0, :, None].to(dtype)], dim=-1)
        conv_state = window.to(cache.dtype)
        conv = (window * weight.to(dtype)).sum(-1)[:, None]
        if bias is not None:
            conv = conv + bias.to(dtype)
        xBC = self.act(conv)
    else:
        ssm_state = None
        if masked:
            xBC = (xBC * attention_mask[:, :, None]).to(xBC.dtype)
        conv, conv_state = torch_causal_conv1d(xBC.to(dtype), weight, bias, output_final_state=use_cache)
        conv_state = conv_state.to(xBC.dtype) if use_cache else None
        xBC = self.act(conv)
        if masked:
            xBC = xBC * attention_mask[:, :, None]

    hidden, B, C = xBC.split([self.intermediate_size, self.n_groups * N, self.n_groups * N], dim=-1)
    hidden = hidden.reshape(batch, seq_len, H, P).to(dtype)
    B, C = (_heads_of_groups(t.to(dtype), H, N) for t in (B, C))
    A = -self.A_log.to(dtype).exp()  # [H]
    dt = F.softplus(dt.to(dtype) + self.dt_bias.to(dtype)).clamp(self.dt_limit[0], self.dt_limit[1])  # [B, T, H]
    # one token: a few small torch ops (in CUDA graphs too); a prefill or training: chunk_simple_gla below
    ssd = torch_fused_recurrent_simple_gla if last_state is not None else chunk_simple_gla
    y, ssm_state = ssd(
        C, B, hidden * dt[..., None], g=dt * A, scale=1.0, initial_state=ssm_state,
        output_final_state=True, state_v_first=True,
    )
    y = y + hidden * self._get_D(expand_to_head_dim=True).to(dtype)
    y = y.reshape(batch, seq_len, self.intermediate_size)
    scan_output = self.norm(y, gate) if self.rmsnorm else y * self.act(gate)
    return self.out_proj(scan_output.to(x.dtype)), conv_state, ssm_state


def _mamba2_forward_cpu(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    past_key_values=None,
    use_cache: bool | None = False,
    output_attentions: bool | None = False,
    **kwargs,
):
    """Mamba2.forward in torch (the CPU, and CUDA without mamba_ssm): fla's control flow and cache updates
    around _mamba2_mix."""
    from fla.layers.utils import get_layer_cache, update_layer_cache

    if hidden_states.shape[1] == 0:
        return hidden_states, None, past_key_values
    last_state = get_layer_cache(self, past_key_values)
    if last_state is None and attention_mask is not None and attention_mask.shape == hidden_states.shape[:2]:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    output, conv_state, ssm_state = _mamba2_mix(self, hidden_states, last_state, use_cache, attention_mask)
    update_layer_cache(
        self, past_key_values, recurrent_state=ssm_state, conv_state=conv_state, offset=hidden_states.shape[1]
    )
    return output, None, past_key_values


OPS: dict[str, FlaOp] = {
    "rmsnorm_fn": FlaOp("fla.modules.layernorm_gated", torch_rmsnorm_fn),
    "layernorm_fn": FlaOp("fla.modules.layernorm_gated", torch_layernorm_fn),
}
def _fla_lacks_mamba2_kernels() -> bool:
    from fla.layers import mamba2

    return not mamba2.is_fast_path_available


MODULE_FORWARDS: dict[str, tuple] = {
    "fla.layers.mamba2:Mamba2": (_mamba2_forward_cpu, "hidden_states", _fla_lacks_mamba2_kernels),
}
