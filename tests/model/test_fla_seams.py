"""Where ccq-eval meets fla's code: the CCQ layers, the CPU backend and the Hopper backward fix run fla's own
functions with some of the names they look up bound to ours (fla_cpu.backend.rebind). These tests pin
that: the code run is fla's, fla's objects are untouched, one model's backend leaves other models alone,
and the fla code we bind into is the code this project was written against."""

import hashlib
import importlib
import inspect

import pytest
import torch
from fla.layers.gated_deltanet import GatedDeltaNet
from fla.layers.gla import GatedLinearAttention
from fla.models import GLAConfig, GLAForCausalLM
from fla.models.modeling_utils import FLAForCausalLM
from fla.modules import RMSNorm
from fla.modules.mlp import GatedMLP, SwiGLULinear

from ccq_eval.model import fla_cpu
from ccq_eval.model.fla_cpu import dispatch, dqkwg
from ccq_eval.model.modeling_ccq import CCQGatedDeltaNet, CCQGatedLinearAttention

# SHA-256 (first 16 hex digits) of inspect.getsource of each fla function ccq-eval runs with its own names
# bound, as in fla 0.6.0 (pyproject.toml pins it).
FLA_SOURCES = {
    "fla.layers.gla.GatedLinearAttention.forward": "a684a63b71ad5304",
    "fla.layers.gated_deltanet.GatedDeltaNet.forward": "c3683941f4ba6e89",
    "fla.modules.mlp.GatedMLP.forward": "9da98c5f171b0d31",
    "fla.modules.mlp.SwiGLULinear.forward": "65681aea7c2edbed",
    "fla.models.modeling_utils.FLAForCausalLM._compute_logits_and_loss": "28aa7a5eab162992",
    "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule": "e6da7107c5b94fba",
    "fla.ops.gated_delta_rule.chunk.ChunkGatedDeltaRuleFunction.backward": "8a9274b55718af90",
    "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_bwd": "5b342b42f3caa97a",
    "fla.ops.simple_gla.chunk.chunk_simple_gla": "0c66b0b2eb547da5",
    "fla.ops.simple_gla.chunk.ChunkSimpleGLAFunction.backward": "b666a489102f358c",
    "fla.ops.simple_gla.chunk.chunk_simple_gla_bwd": "c1cfa33191106a58",
    # the other families' layers whose op names the backend binds (or whose CPU forward follows fla's control
    # flow: Mamba2, RWKV7's feed-forward, the gated norm, rotary embeddings)
    "fla.layers.delta_net.DeltaNet.forward": "95810c54f4ae7336",
    "fla.layers.hgrn2.HGRN2Attention.forward": "0f9f494baf79ef0b",
    "fla.layers.kda.KimiDeltaAttention.forward": "fc5dedde41cb3d29",
    "fla.layers.mamba2.Mamba2.forward": "4b562fa0289480d4",
    "fla.layers.multiscale_retention.MultiScaleRetention.forward": "6d6c4c3c407309cf",
    "fla.layers.precond_gated_deltanet.PrecondGatedDeltaNet.forward": "b4bbe24e1d5f06cc",
    "fla.layers.precond_kda.PrecondKDA.forward": "869ff713db41afb2",
    "fla.layers.rwkv7.RWKV7Attention.forward": "53ed44c88c388a1f",
    "fla.models.rwkv7.modeling_rwkv7.RWKV7FeedForward.forward": "71893321628cbcb2",
    "fla.modules.norm.layernorm_gated.RMSNormGated.forward": "341db4f44340805e",
    "fla.modules.rotary.ops.RotaryEmbedding.forward": "a46539c556634dd8",
}


def _fla_function(dotted: str):
    """The (undecorated) fla function at a dotted path module.attribute[.member]."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            target = getattr(target, name)
        return inspect.unwrap(target)
    raise ImportError(dotted)


def test_the_fla_code_ccq_eval_binds_into_is_the_code_it_was_written_against():
    changed = [path for path, digest in FLA_SOURCES.items()
               if hashlib.sha256(inspect.getsource(_fla_function(path)).encode()).hexdigest()[:16] != digest]
    assert not changed, (
        "The installed fla's source differs from fla 0.6.0 in: " + ", ".join(changed) + ". ccq-eval runs these "
        "functions with its own kernels / losses bound to the names they call (CCQ's q~ enters at the kernel "
        "call, the state tuple through initial_state / the returned state): re-check ccq_eval/model/"
        "modeling_ccq.py and fla_cpu/backend.py, dqkwg.py against the new code, then update FLA_SOURCES.")


def test_ccq_layers_run_fla_forward_code():
    from fla.layers.delta_net import DeltaNet
    from fla.layers.kda import KimiDeltaAttention
    from fla.layers.multiscale_retention import MultiScaleRetention
    from fla.layers.precond_gated_deltanet import PrecondGatedDeltaNet

    from ccq_eval.model.backbones.delta_net import CCQDeltaNet
    from ccq_eval.model.backbones.kda import CCQKimiDeltaAttention
    from ccq_eval.model.backbones.mamba2 import CCQMamba2
    from ccq_eval.model.backbones.precond_gated_deltanet import CCQPrecondGatedDeltaNet
    from ccq_eval.model.backbones.retnet import CCQMultiScaleRetention
    from ccq_eval.model.fla_cpu import mamba2

    for ccq_cls, fla_cls in ((CCQGatedLinearAttention, GatedLinearAttention), (CCQGatedDeltaNet, GatedDeltaNet),
                             (CCQDeltaNet, DeltaNet), (CCQKimiDeltaAttention, KimiDeltaAttention),
                             (CCQMultiScaleRetention, MultiScaleRetention),
                             (CCQPrecondGatedDeltaNet, PrecondGatedDeltaNet)):
        assert ccq_cls._fla_forward.__code__ is fla_cls.forward.__code__
        # only fla's op names are bound: the read kernels to the CCQ reads, the refused ones (fla's naive torch
        # reference among them) to the refusal, the rest to the dispatchers
        changed = {name for name, value in ccq_cls._fla_forward.__globals__.items()
                   if value is not fla_cls.forward.__globals__.get(name)}
        assert changed <= set(dispatch.OPS) | set(ccq_cls.ccq_backbone.refused_kernels), changed
        assert set(ccq_cls.ccq_backbone.read_kernels) <= changed
    # Mamba2: fla's forward runs mamba_ssm's scan; the CCQ layer runs the torch backend's forward of the layer
    assert CCQMamba2._fla_forward.__code__ is mamba2._mamba2_forward_cpu.__code__
    mix = CCQMamba2._fla_forward.__globals__["_mamba2_mix"]
    assert mix.__code__ is mamba2._mamba2_mix.__code__ and mamba2._mamba2_mix.__globals__ is vars(mamba2)
    for fla_cls in (GatedLinearAttention, GatedDeltaNet, GatedMLP, SwiGLULinear):
        assert fla_cpu.torch_backend_class(fla_cls).forward.__code__ is fla_cls.forward.__code__


def test_rebind_changes_only_the_copy_and_refuses_names_the_code_does_not_use():
    import fla.layers.gla as fla_gla

    original = fla_gla.chunk_gla
    copy = fla_cpu.rebind(GatedLinearAttention.forward, chunk_gla=dispatch.chunk_gla)
    assert copy.__globals__["chunk_gla"] is dispatch.chunk_gla
    assert fla_gla.chunk_gla is original and GatedLinearAttention.forward.__globals__["chunk_gla"] is original
    with pytest.raises(ValueError) as error:
        fla_cpu.rebind(GatedLinearAttention.forward, chunk_simple_gla=dispatch.chunk_simple_gla)
    assert str(error.value) == (
        "rebind: fla.layers.gla.GatedLinearAttention.forward does not look up ['chunk_simple_gla']; the "
        "installed fla differs from the one ccq-eval was written against (pyproject.toml pins it).")
    from fla.modules import FusedLinearCrossEntropyLoss

    with pytest.raises(TypeError, match="is a decorated wrapper; rebind the function it wraps"):
        fla_cpu.rebind(FusedLinearCrossEntropyLoss.forward)


def _plain_gla(seed):
    """fuse_norm=False: the layer keeps fla's swish from ACT2FN as its output gate (gate_fn)."""
    torch.manual_seed(seed)
    return GLAForCausalLM(GLAConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=64,
                                    intermediate_size=64, use_short_conv=True, fuse_norm=False))


def test_use_torch_backend_changes_that_model_only():
    served, other = _plain_gla(0), _plain_gla(0)
    keys = list(served.state_dict())
    assert fla_cpu.use_torch_backend(served) is served
    fla_cpu.use_torch_backend(served)  # idempotent: no subclass of a subclass
    layer = served.model.layers[0].attn
    assert type(layer).__bases__ == (GatedLinearAttention,) and type(layer).__name__ == "GatedLinearAttention"
    assert type(served).__bases__ == (GLAForCausalLM,) and type(served).__name__ == "GLAForCausalLM"
    assert layer.gate_fn is dispatch.swish and other.model.layers[0].attn.gate_fn is not dispatch.swish
    assert list(served.state_dict()) == keys
    # the other model and fla's classes are as fla made them
    assert all(type(module).__module__.startswith(("fla.", "torch.")) for module in other.modules())
    assert RMSNorm.forward.__module__.startswith("fla.")
    assert FLAForCausalLM._compute_logits_and_loss.__globals__ is importlib.import_module(
        "fla.models.modeling_utils").__dict__
    ids = torch.randint(0, 64, (1, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.isfinite(served(ids, use_cache=False).logits).all()


def test_hopper_safe_op_is_fla_code_with_only_chunk_bwd_dqkwg_replaced():
    from fla.ops.common import chunk_o

    for name, (module_name, function_name, bwd_name) in dqkwg.DQKWG_CALLERS.items():
        module = importlib.import_module(module_name)
        op = inspect.unwrap(dqkwg.hopper_safe_op(name))
        assert op.__code__ is inspect.unwrap(getattr(module, name)).__code__
        safe_function = op.__globals__[function_name]
        assert safe_function is not getattr(module, function_name)
        assert issubclass(safe_function, getattr(module, function_name))
        backward = inspect.unwrap(safe_function.backward)
        assert backward.__code__ is inspect.unwrap(getattr(module, function_name).backward).__code__
        bwd = backward.__globals__[bwd_name]
        assert bwd.__code__ is getattr(module, bwd_name).__code__
        assert bwd.__globals__["chunk_bwd_dqkwg"] is not chunk_o.chunk_bwd_dqkwg
        assert module.chunk_bwd_dqkwg is chunk_o.chunk_bwd_dqkwg  # fla's own module: untouched


def test_cuda_calls_use_the_hopper_safe_op_only_where_fla_refuses_its_kernel(monkeypatch):
    for affected in (False, True):
        monkeypatch.setattr(dqkwg, "hopper_triton_affected", lambda affected=affected: affected)
        for name in dqkwg.DQKWG_CALLERS:
            expected = dqkwg.hopper_safe_op(name) if affected else dispatch.fla_original(name)
            assert dispatch._cuda_function(name) is expected
        assert dispatch._cuda_function("chunk_gla") is dispatch.fla_original("chunk_gla")


def test_ccq_reads_pass_baseline_calls_through_and_refuse_a_changed_gated_deltanet_call(monkeypatch):
    from ccq_eval.model.backbones import seam
    from ccq_eval.model.backbones.gated_deltanet import GatedDeltaNetBackbone

    seen = []
    monkeypatch.setitem(seam.READ_KERNELS, "chunk_gated_delta_rule",
                        lambda **kwargs: seen.append(kwargs) or ("o", "state"))
    read = seam.ccq_kernel_read(GatedDeltaNetBackbone(), "chunk_gated_delta_rule")
    q, k, g = torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2)
    # no CCQ layer reading (a baseline layer): fla's call, unchanged
    assert read(q=q, k=k, g=g, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True) == ("o", "state")
    assert seen[0]["q"] is q and seen[0]["use_qk_l2norm_in_kernel"] is True
    layer = _plain_gla(0).model.layers[0].attn  # any layer object: the call is refused before it is used
    token = seam._CCQ_LAYER.set(layer)
    try:
        with pytest.raises(RuntimeError) as error:
            read(q=q, k=k, g=g, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=True)
    finally:
        seam._CCQ_LAYER.reset(token)
    assert str(error.value) == (
        "CCQ: fla's GatedDeltaNet calls chunk_gated_delta_rule without use_qk_l2norm_in_kernel / "
        "use_gate_in_kernel; the installed fla differs from the one ccq-eval was written against "
        "(pyproject.toml pins it).")
    assert len(seen) == 1  # nothing reached the kernel


def test_the_reading_layer_is_reset_after_a_forward_that_fails():
    from ccq_eval.model import modeling_ccq
    from ccq_eval.model.modeling_ccq import CCQGLAConfig, CCQGLAForCausalLM

    model = CCQGLAForCausalLM(CCQGLAConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=64,
                                           intermediate_size=64, ccq=True))
    mask = torch.tensor([[0, 1, 1]])  # padding: CCQ layers refuse it
    with pytest.raises(ValueError, match="padded batches"):
        model(torch.tensor([[1, 2, 3]]), attention_mask=mask, use_cache=False)
    assert modeling_ccq._CCQ_LAYER.get() is None


def test_models_with_the_backend_pickle_and_compute_the_same():
    import pickle

    from ccq_eval.model.modeling_ccq import CCQGLAConfig, CCQGLAForCausalLM

    torch.manual_seed(0)
    ccq_model = CCQGLAForCausalLM(CCQGLAConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=64,
                                               intermediate_size=64, use_short_conv=True, ccq=True))
    ids = torch.randint(0, 64, (1, 70), generator=torch.Generator().manual_seed(1))
    for model in (fla_cpu.use_torch_backend(_plain_gla(0)), ccq_model):
        restored = pickle.loads(pickle.dumps(model))
        assert [type(m) for m in restored.modules()] == [type(m) for m in model.modules()]
        with torch.no_grad():
            assert torch.equal(restored(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
