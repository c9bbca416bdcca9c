"""What a GLA / Gated DeltaNet layer reads, captured from one forward pass, and the read decomposed.

Capture. `ReadRecorder` wraps, for the duration of a `with` block, the kernels the CCQ model classes'
layers read with (ccq_eval.model.modeling_ccq.READ_KERNELS: chunk_gla / fused_recurrent_gla,
chunk_gated_delta_rule / fused_recurrent_gated_delta_rule; fla's triton on CUDA, the project's torch
backend on CPU) and, on CCQ layers, the layer's `ccq_query`. A forward
pre-hook on each attention layer says which layer a call belongs to. Per layer it records the
kernel's inputs as the kernel interprets them (Gated DeltaNet: q, k L2-normalised, beta = sigmoid,
log decay g = -exp(A_log) softplus(a + dt_bias), as ccq_eval.model.fla_cpu.delta_rule applies
them), the kernel's output o (the read before output norm and gate), and for CCQ layers r, the raw
keys, the scalar log decay and q~. The wrappers compute nothing the model sees.

The read as a sum over tokens. With scale s = K^-0.5 (fla's default):
- GLA: S_t = diag(alpha_t) S_{t-1} + k_t v_t^T and o_t = s q_t^T S_t, so
  o_t = sum_{i<=t} c_i v_i with c_i = s (q_t * prod_{j=i+1..t} alpha_j) . k_i  (`gla_read_weights`).
- Gated DeltaNet (fla's order: decay, then the delta update): S_t = A_t S_{t-1} + beta_t k_t v_t^T
  with A_t = exp(g_t) (I - beta_t k_t k_t^T), so o_t = sum_i c_i v_i with
  c_i = s beta_i q_t^T A_t A_{t-1} ... A_{i+1} k_i. `gdn_read_weights` carries u = s q_t backwards,
  u <- A_i^T u = exp(g_i) (u - beta_i k_i (k_i . u)) (A_i is symmetric), O(T K) in all.
The needle share of a read is sum_{i in needle} ||c_i v_i|| / sum_{i<=t} ||c_i v_i||.

The key covariance (docs/operator.md): with unit keys kappa and CCQ's scalar decay gamma,
`decayed_moments` gives n_t, m_t and P_t = sum_i w_{i,t} kappa_i kappa_i^T at chosen positions
(one pass over the sequence), from which Sigma_t = P_t / n_t - mu_t mu_t^T (centered) or P_t / n_t.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ccq_eval.inspection import InspectError

GLA_KERNELS = ("chunk_gla", "fused_recurrent_gla")
GDN_KERNELS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")


# ------------------------------------------------------------------------------------------------
# The read as a sum over tokens


def gla_read_weights(q_t: torch.Tensor, k: torch.Tensor, log_alpha: torch.Tensor, t: int,
                     scale: float) -> torch.Tensor:
    """c [..., t+1]: c_i = scale (q_t * prod_{j=i+1..t} alpha_j) . k_i for GLA's per-channel decay.

    q_t [..., K] (leading dims broadcast against k's), k and log_alpha [..., T, K] (log alpha: the
    per-step log decays the kernel receives)."""
    cum = log_alpha[..., : t + 1, :].cumsum(-2)
    decay = (cum[..., t : t + 1, :] - cum).exp()  # prod_{j=i+1..t} alpha_j, exponent <= 0
    return scale * ((q_t.unsqueeze(-2) * decay) * k[..., : t + 1, :]).sum(-1)


def gdn_read_weights(q_t: torch.Tensor, k: torch.Tensor, log_g: torch.Tensor, beta: torch.Tensor, t: int,
                     scale: float) -> torch.Tensor:
    """c [..., t+1]: c_i = scale beta_i q_t^T A_t ... A_{i+1} k_i, A_j = exp(g_j) (I - beta_j k_j k_j^T).

    q_t [..., K] (leading dims broadcast, e.g. [2, H, K] for two queries), k [H, T, K], log_g and
    beta [H, T]: the gated delta rule's unit keys, per-step log decay and write strength."""
    u = scale * q_t
    weights = []
    for i in range(t, -1, -1):
        k_i = k[..., i, :]
        dot = (u * k_i).sum(-1)
        weights.append(beta[..., i] * dot)
        u = log_g[..., i].exp().unsqueeze(-1) * (u - (beta[..., i] * dot).unsqueeze(-1) * k_i)
    return torch.stack(weights[::-1], -1)


def read_from_weights(c: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum_i c_i v_i: c [..., n], v [..., T, V] (the first n positions) -> [..., V]."""
    return (c.unsqueeze(-1) * v[..., : c.shape[-1], :]).sum(-2)


def token_shares(c: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """||c_i v_i|| / sum_j ||c_j v_j|| for every token i <= t: c [..., n], v [..., T, V] -> [..., n]."""
    contribution = c.abs() * v[..., : c.shape[-1], :].norm(dim=-1)
    return contribution / contribution.sum(-1, keepdim=True).clamp_min(torch.finfo(c.dtype).tiny)


# ------------------------------------------------------------------------------------------------
# The key covariance


def decayed_moments(kappa: torch.Tensor, log_gamma: torch.Tensor, positions: list[int]):
    """n [H, P], m [H, P, K], P [H, P, K, K] at the given increasing positions: the decayed sums
    n_t = sum_{i<=t} w_{i,t}, m_t = sum_i w_{i,t} kappa_i, P_t = sum_i w_{i,t} kappa_i kappa_i^T with
    w_{i,t} = prod_{j=i+1..t} gamma_j. kappa [H, T, K], log_gamma [H, T]; one pass over the sequence."""
    H, _, K = kappa.shape
    n = kappa.new_zeros(H)
    m = kappa.new_zeros(H, K)
    second = kappa.new_zeros(H, K, K)
    out_n, out_m, out_second = [], [], []
    start = 0
    for position in positions:
        if position < start - 1:
            raise ValueError(f"positions must increase, got {positions}")
        if position >= start:
            seg = slice(start, position + 1)
            cum = log_gamma[:, seg].cumsum(-1)
            w = (cum[:, -1:] - cum).exp()  # [H, L]: decay from each token of the segment to `position`
            carry = cum[:, -1].exp()  # decay of the sums entering the segment
            n = carry * n + w.sum(-1)
            m = carry.unsqueeze(-1) * m + (w.unsqueeze(-1) * kappa[:, seg]).sum(1)
            weighted = w.unsqueeze(-1) * kappa[:, seg]
            second = carry[:, None, None] * second + weighted.transpose(1, 2) @ kappa[:, seg]
            start = position + 1
        out_n.append(n)
        out_m.append(m)
        out_second.append(second)
    return torch.stack(out_n, 1), torch.stack(out_m, 1), torch.stack(out_second, 1)


def key_covariance(n: torch.Tensor, m: torch.Tensor, second: torch.Tensor, centered: bool) -> torch.Tensor:
    """Sigma = P / n - mu mu^T (centered) or P / n, from `decayed_moments`; symmetrised against rounding."""
    sigma = second / n[..., None, None]
    if centered:
        mu = m / n[..., None]
        sigma = sigma - mu.unsqueeze(-1) * mu.unsqueeze(-2)
    return 0.5 * (sigma + sigma.transpose(-1, -2))


def ccq_query_from_sigma(sigma: torch.Tensor, r: torch.Tensor, lam: torch.Tensor, order: int,
                         form: str = "series") -> torch.Tensor:
    """q~ from an explicit Sigma [..., K, K], by the model's own read form (ccq.apply_read_form):
    the series of order `order`, or the resolvent by `order` conjugate-gradient steps, exactly as a
    CCQ layer computes it. r [..., K], lam [...]."""
    from ccq_eval.model.ccq import apply_read_form

    return apply_read_form(form, r, lam.unsqueeze(-1), order, lambda u: (sigma @ u.unsqueeze(-1)).squeeze(-1))


# ------------------------------------------------------------------------------------------------
# Capture


@dataclass
class LayerRead:
    """One attention layer's read of one prompt (batch 1), heads first, in the analysis dtype.

    q: the query the kernel read with (q~ on a CCQ layer); k, v: keys and values as the kernel used
    them; log_decay: GLA [H, T, K] per-channel log alpha, Gated DeltaNet [H, T] log g; beta [H, T]
    (Gated DeltaNet); output: the kernel's o [H, T, V]; scale: the kernel's query scale. CCQ layers
    also give r (the query before CCQ), ccq_keys (the keys CCQ normalises), ccq_log_gamma [H, T] and
    lam [H, T] (the gate's lambda_t)."""

    family: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    log_decay: torch.Tensor
    output: torch.Tensor
    scale: float
    beta: torch.Tensor | None = None
    r: torch.Tensor | None = None
    ccq_keys: torch.Tensor | None = None
    ccq_log_gamma: torch.Tensor | None = None
    lam: torch.Tensor | None = None
    ccq_query: torch.Tensor | None = None


def _heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, T, H, ...] -> [H, T, ...] in dtype."""
    if x.shape[0] != 1:
        raise InspectError(f"inspect reads one prompt at a time (batch 1), got batch {x.shape[0]}")
    return x[0].transpose(0, 1).to(dtype)


def attention_layers(model) -> list:
    """The GLA / Gated DeltaNet attention layers of a model loaded by ccq_eval.model.load_model (the
    classes whose reads go through READ_KERNELS), in order."""
    from fla.layers.gated_deltanet import GatedDeltaNet
    from fla.layers.gla import GatedLinearAttention

    from ccq_eval.model.modeling_ccq import CCQReadMixin

    blocks = getattr(getattr(model, "model", None), "layers", None) or []
    layers = [getattr(block, "attn", None) for block in blocks]
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if not layers or not all(isinstance(x, (GatedLinearAttention, GatedDeltaNet)) for x in layers):
        raise InspectError(
            f"inspect reads the recurrent state of GLA / Gated DeltaNet layers; this model ({kind}) has "
            "other layers (e.g. softmax attention): pass a GLA or Gated DeltaNet checkpoint")
    if not all(isinstance(x, CCQReadMixin) for x in layers):
        raise InspectError(
            f"inspect reads the layers of models loaded by ccq-eval; this {kind} model was built by fla's own "
            "classes: load it with ccq_eval.model.loading.load_model")
    return layers


class ReadRecorder:
    """Records every attention layer's read during forward passes inside `with recorder.capture():`.

    Without `on_read`, `reads` holds one LayerRead per layer after a forward (`ordered()` lists them,
    `clear()` empties them). With on_read(layer index, LayerRead), each read is handed over as soon as
    its kernel returns and not kept, so a long prompt holds one layer's tensors at a time; `seen` lists
    the layers handed over since `clear()`.
    """

    def __init__(self, model, dtype: torch.dtype = torch.float64, on_read=None):
        self.layers = attention_layers(model)
        self.dtype = dtype
        self.on_read = on_read
        self.reads: dict[int, LayerRead] = {}
        self.seen: set[int] = set()
        self._ccq_inputs: dict[int, dict] = {}
        self._current: int | None = None

    def clear(self) -> None:
        self.reads.clear()
        self.seen.clear()
        self._ccq_inputs.clear()

    def check_complete(self) -> None:
        missing = [i for i in range(len(self.layers)) if i not in self.seen]
        if missing:
            raise InspectError(f"no read was captured for layers {missing}: the forward did not reach their kernels")

    def ordered(self) -> list[LayerRead]:
        self.check_complete()
        return [self.reads[i] for i in range(len(self.layers))]

    @contextlib.contextmanager
    def capture(self):
        from ccq_eval.model.modeling_ccq import READ_KERNELS

        kernels, hooks = dict(READ_KERNELS), []
        try:
            for name in (*GLA_KERNELS, *GDN_KERNELS):
                READ_KERNELS[name] = self._kernel_wrapper(name, kernels[name])
            for index, layer in enumerate(self.layers):
                hooks.append(layer.register_forward_pre_hook(self._enter(index)))
                if getattr(layer, "ccq_enabled", False):
                    layer.ccq_query = self._ccq_wrapper(index, layer.ccq_query)
            yield self
        finally:
            READ_KERNELS.update(kernels)
            for hook in hooks:
                hook.remove()
            for layer in self.layers:
                layer.__dict__.pop("ccq_query", None)
            self._current = None

    def _enter(self, index: int):
        def hook(module, args):
            self._current = index
        return hook

    def _ccq_wrapper(self, index: int, method):
        def ccq_query(r, k, log_decay, ccq_state, keys_unit=False):
            q, state = method(r, k, log_decay, ccq_state, keys_unit=keys_unit)
            layer = self.layers[index]
            log_gamma = torch.zeros_like(log_decay) if layer.ccq_decay == "none" else log_decay
            self._ccq_inputs[index] = {
                "r": _heads_first(r, self.dtype), "ccq_keys": _heads_first(k, self.dtype),
                "ccq_log_gamma": _heads_first(log_gamma, self.dtype), "ccq_query": _heads_first(q, self.dtype),
                "lam": _heads_first(layer.ccq_read_gate().values(r.detach()), self.dtype),
            }
            return q, state
        return ccq_query

    def _kernel_wrapper(self, name: str, kernel):
        def wrapper(*args, **kwargs):
            out = kernel(*args, **kwargs)
            if self._current is None:  # a call from outside the model's layers: not ours to record
                return out
            if args:
                raise InspectError(f"inspect expects fla's layers to call {name} by keyword")
            o = out[0] if isinstance(out, tuple) else out
            index, self._current = self._current, None
            read = self._gla_read(kwargs, o) if name in GLA_KERNELS else self._gdn_read(kwargs, o)
            for key, value in self._ccq_inputs.pop(index, {}).items():
                setattr(read, key, value)
            self.seen.add(index)
            if self.on_read is None:
                self.reads[index] = read
            else:
                self.on_read(index, read)
            return out
        return wrapper

    def _gla_read(self, kw: dict, o: torch.Tensor) -> LayerRead:
        if kw.get("gv") is not None:
            raise InspectError("inspect does not support GLA with value gates (use_gv)")
        if kw.get("initial_state") is not None or kw.get("cu_seqlens") is not None:
            raise InspectError("inspect reads whole prompts from an empty state, without padding")
        q, k = kw["q"], kw["k"]
        g = kw.get("g", kw.get("gk"))
        scale = kw.get("scale")
        return LayerRead("gla", _heads_first(q, self.dtype), _heads_first(k, self.dtype),
                         _heads_first(kw["v"], self.dtype), _heads_first(g, self.dtype),
                         _heads_first(o, self.dtype), q.shape[-1] ** -0.5 if scale is None else float(scale))

    def _gdn_read(self, kw: dict, o: torch.Tensor) -> LayerRead:
        from ccq_eval.model.fla_cpu.delta_rule import gdn_inputs

        if kw.get("initial_state") is not None or kw.get("cu_seqlens") is not None:
            raise InspectError("inspect reads whole prompts from an empty state, without padding")
        q, k, v = kw["q"], kw["k"], kw["v"]
        if v.shape[2] != q.shape[2]:
            raise InspectError(f"inspect needs as many value heads as key heads (got {v.shape[2]} and "
                               f"{q.shape[2]}): grouped value heads are not supported")
        with torch.no_grad():
            q_scaled, k_used, v_used, g, beta = gdn_inputs(
                q, k, v, kw.get("g"), kw.get("beta"), kw.get("scale"), kw.get("use_qk_l2norm_in_kernel", False),
                kw.get("use_beta_sigmoid_in_kernel", False), kw.get("allow_neg_eigval", False),
                kw.get("use_gate_in_kernel", False), kw.get("A_log"), kw.get("dt_bias"), self.dtype)
        scale = q.shape[-1] ** -0.5 if kw.get("scale") is None else float(kw["scale"])
        if g is None:
            g = torch.zeros(v.shape[:3], dtype=self.dtype, device=v.device)
        return LayerRead("gated_deltanet", _heads_first(q_scaled / scale, self.dtype), _heads_first(k_used, self.dtype),
                         _heads_first(v_used, self.dtype), _heads_first(g, self.dtype), _heads_first(o, self.dtype),
                         scale, beta=_heads_first(beta, self.dtype))


def read_weights(read: LayerRead, queries: torch.Tensor, t: int) -> torch.Tensor:
    """c [N, H, t+1] for N queries [N, H, K] read from this layer's state at position t."""
    if read.family == "gla":
        return gla_read_weights(queries, read.k, read.log_decay, t, read.scale)
    return gdn_read_weights(queries, read.k, read.log_decay, read.beta, t, read.scale)
