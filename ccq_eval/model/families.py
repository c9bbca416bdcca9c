"""Which model families ccq-eval loads, and where each runs: read off fla's and transformers' registrations.

Three sources, in this order of precedence for a checkpoint's `model_type`:
- ccq-eval's own classes (the `ccq_*` types of every backbone CCQ attaches to, and plain `gla` and
  `gated_deltanet`): fla's models with the CCQ read (modeling_ccq);
- every causal-LM family the installed fla registers with transformers' Auto classes (`import fla`
  registers them): fla's own classes, with fla_cpu's backend for the CPU;
- every causal LM transformers itself ships (Llama, Qwen2, Mistral, ...), as transformers defines it.

Nothing here is a hand-kept list of families. What is kept by hand is what fla_cpu serves: the fla layer
classes whose every op has a torch version (CPU_LAYERS, each pinned by a test that runs a tiny model of a
family using it). A family runs on the CPU when every layer its modeling module uses is among them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import cache

# fla layers (module:class) that run on the CPU: every op served by fla_cpu (tests/model/test_fla_cpu_*.py), or
# torch already (fla's Mamba); tests/model/test_families.py runs a tiny model of each family through the adapter.
CPU_LAYERS = frozenset({
    "fla.layers.gla:GatedLinearAttention",
    "fla.layers.gated_deltanet:GatedDeltaNet",
    "fla.layers.mamba:Mamba",
    "fla.layers.rwkv7:RWKV7Attention",
    "fla.layers.delta_net:DeltaNet",
    "fla.layers.kda:KimiDeltaAttention",
    "fla.layers.precond_gated_deltanet:PrecondGatedDeltaNet",
    "fla.layers.precond_kda:PrecondKDA",
    "fla.layers.mamba2:Mamba2",
    "fla.layers.multiscale_retention:MultiScaleRetention",
    "fla.layers.hgrn2:HGRN2Attention",
})
# fla layers whose cache, once it holds a state, takes one new token per call (each raises "cached decoding
# only supports a single new token per step"; tests/model/test_families.py finds them in fla's source): a
# text goes through such a model in one forward, then token by token.
ONE_TOKEN_CACHE_LAYERS = frozenset({
    "fla.layers.mamba:Mamba",
    "fla.layers.mamba2:Mamba2",
    "fla.layers.mamba3:Mamba3",
    "fla.layers.log_linear_mamba2:LogLinearMamba2",
})
# Model types whose CUDA fast path (graphed decode and scoring, batches sized by free memory) the GPU tests
# tie to batch 1 (tests/harness/test_ruler_batch_gpu.py, tests/model/test_graphed_decode.py,
# tests/model/test_families_gpu.py); the adapter runs other families eagerly at batch 1 on CUDA unless asked
# otherwise. RetNet is left out: its graphed batch decodes other tokens than batch 1 does.
GPU_FAST_PATH_MEASURED = frozenset({"gla", "gated_deltanet", "ccq_gla", "ccq_gated_deltanet", "delta_net", "kda",
                                    "hgrn2", "rwkv7", "precond_gated_deltanet", "precond_kda", "mamba", "mamba2"})
# fla layers whose chunked CUDA kernel refuses float32 inputs (fla asserts in the op): on CUDA their families
# run in bfloat16 or float16.
CUDA_HALF_ONLY_LAYERS = {
    "fla.layers.delta_net:DeltaNet": "chunk_delta_rule",
    "fla.layers.gated_deltaproduct:GatedDeltaProduct": "chunk_gated_delta_product",
}
# fla's softmax attention: flash-attn's kernels only (fla/layers/attn.py imports flash_attn), so a family
# made of it, or a hybrid config that puts it in some layers (`attn`), needs a GPU with flash-attn.
FLA_ATTENTION = "fla.layers.attn:Attention"


@dataclass(frozen=True)
class Family:
    """One model type a checkpoint's config.json may name.

    Attributes:
        model_type: transformers' name of the family (config.json "model_type").
        source: "ccq-eval", "fla" or "transformers": whose classes load it.
        config_class, model_class: the configuration and causal-LM classes.
        layers: the fla layer classes (module:class) the family's modeling module uses (fla families).
        cpu_blocker: why it cannot run on the CPU, or None when it can.
    """

    model_type: str
    source: str
    config_class: type
    model_class: type
    layers: tuple[str, ...] = ()
    cpu_blocker: str | None = None

    @property
    def devices(self) -> str:
        return "cuda" if self.cpu_blocker else "cpu, cuda"

    @property
    def sliced_cache(self) -> bool:
        """Whether a text can go through the model in slices of several tokens with one carried cache."""
        return not ONE_TOKEN_CACHE_LAYERS.intersection(self.layers)

    @property
    def cuda_float32_blocker(self) -> str | None:
        """Why the family cannot run in float32 on CUDA (a kernel that refuses it), or None when it can."""
        kernels = sorted({CUDA_HALF_ONLY_LAYERS[layer] for layer in self.layers if layer in CUDA_HALF_ONLY_LAYERS})
        return f"fla's {', '.join(kernels)} refuses float32 on CUDA" if kernels else None

    @property
    def gpu_fast_path_measured(self) -> bool:
        return self.model_type in GPU_FAST_PATH_MEASURED

    @property
    def has_ccq(self) -> bool:
        """Whether ccq-eval's CCQ classes load this family (ccq_eval.model.modeling_ccq)."""
        return self.source == "ccq-eval"


def _layer_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__name__}"


def _fla_layers(model_class: type) -> tuple[str, ...]:
    """The fla layer classes named in the module that defines `model_class` (its blocks build them)."""
    module = inspect.getmodule(model_class)
    return tuple(sorted({_layer_name(value) for value in vars(module).values()
                         if inspect.isclass(value) and value.__module__.startswith("fla.layers.")}))


def _cpu_blocker(layers: tuple[str, ...]) -> str | None:
    """Why a family using `layers` cannot run on the CPU (None: it can). fla's Attention imported beside
    other layers is the hybrid option (config `attn`), checked per checkpoint by config_cpu_blocker."""
    own_layers = [layer for layer in layers if layer != FLA_ATTENTION] or list(layers)
    if not own_layers:
        return "its modeling code names no fla layer, so ccq-eval cannot tell which ops it needs"
    if own_layers == [FLA_ATTENTION]:
        return "fla's softmax attention runs on flash-attn's GPU kernels only"
    missing = [layer.partition(":")[2] for layer in own_layers if layer not in CPU_LAYERS]
    if missing:
        return f"ccq-eval has no CPU version of fla's {', '.join(missing)} ops (fla ships triton kernels only)"
    return None


@cache
def fla_families() -> dict[str, Family]:
    """model_type -> Family for every causal LM the installed fla registers (fla.models' config classes
    with a class in transformers' AutoModelForCausalLM mapping)."""
    import fla.models
    from transformers import PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    families = {}
    for name in fla.models.__all__:
        config_class = getattr(fla.models, name)
        if not (inspect.isclass(config_class) and issubclass(config_class, PretrainedConfig)):
            continue
        try:
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
        except KeyError:
            continue
        layers = _fla_layers(model_class)
        # A hybrid family whose default config already places softmax-attention layers (Samba) is listed as
        # GPU-only; a checkpoint's own config decides when it loads (config_cpu_blocker).
        blocker = _cpu_blocker(layers) or _hybrid_attention_blocker(getattr(config_class(), "attn", None))
        families[config_class.model_type] = Family(config_class.model_type, "fla", config_class, model_class,
                                                   layers, blocker)
    return families


# Plain fla model types that load into the CCQ classes (with ccq=False unless asked) rather than fla's own:
# GLA and Gated DeltaNet, whose embedded checkpoints and results were made that way. A plain checkpoint of
# every other backbone in modeling_ccq.CCQ_CLASSES loads as fla's model; CCQ attaches to it on request
# (`ccq=True`, `--ccq-attach`) through ccq_family_for.
PLAIN_TYPES_IN_CCQ_CLASSES = ("gla", "gated_deltanet")


@cache
def ccq_families() -> dict[str, Family]:
    """model_type -> Family for the types ccq-eval's CCQ classes load: every `ccq_<family>` type of
    modeling_ccq.CCQ_CLASSES, and plain fla GLA / Gated DeltaNet (PLAIN_TYPES_IN_CCQ_CLASSES)."""
    from ccq_eval.model.modeling_ccq import CCQ_CLASSES

    families = {}
    for plain, (config_class, model_class) in CCQ_CLASSES.items():
        types = (plain, config_class.model_type) if plain in PLAIN_TYPES_IN_CCQ_CLASSES else (config_class.model_type,)
        for model_type in types:
            families[model_type] = Family(model_type, "ccq-eval", config_class, model_class,
                                          fla_families()[plain].layers, fla_families()[plain].cpu_blocker)
    return families


def ccq_family_for(model_type: str | None) -> Family | None:
    """The CCQ family a checkpoint of `model_type` loads into when CCQ is attached to it (its own family when
    that is one of ccq-eval's), or None when CCQ has no backbone for it."""
    from ccq_eval.model.modeling_ccq import CCQ_CLASSES

    if not isinstance(model_type, str):
        return None
    if model_type in ccq_families():
        return ccq_families()[model_type]
    if model_type in CCQ_CLASSES:
        return ccq_families()[CCQ_CLASSES[model_type][0].model_type]
    return None


def ccq_backbone_types() -> list[str]:
    """The plain model types CCQ attaches to, in modeling_ccq.CCQ_CLASSES's order."""
    from ccq_eval.model.modeling_ccq import CCQ_CLASSES

    return list(CCQ_CLASSES)


def transformers_family(model_type: str) -> Family | None:
    """transformers' own causal LM of this model type (not fla's), or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    return Family(model_type, "transformers", config_class, MODEL_FOR_CAUSAL_LM_MAPPING[config_class])


def transformers_causal_lm_types() -> list[str]:
    """Every model type transformers ships a causal LM for (its own Auto mapping, not fla's additions)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) & set(CONFIG_MAPPING_NAMES))


def family_of(model_type: str | None) -> Family | None:
    """The family that loads `model_type` (ccq-eval's, then fla's, then transformers'), or None."""
    if not isinstance(model_type, str):
        return None
    return ccq_families().get(model_type) or fla_families().get(model_type) or transformers_family(model_type)


def _hybrid_attention_blocker(attn: object) -> str | None:
    if attn:
        return "its config puts fla's softmax attention (flash-attn, GPU only) in some layers (\"attn\")"
    return None


def config_cpu_blocker(family: Family, config_fields: dict) -> str | None:
    """Why this checkpoint of `family` cannot run on the CPU (None: it can): its own layers, an fla hybrid
    config with softmax-attention layers (`attn`), which need flash-attn, or fla's attention residuals."""
    if family.source == "transformers":
        return None
    if config_fields.get("attnres_block_size"):
        return "its config turns on fla's attention residuals (\"attnres_block_size\"), a triton-only kernel"
    return _cpu_blocker(family.layers) or _hybrid_attention_blocker(config_fields.get("attn"))


def unknown_type_message(model_type: object) -> str:
    """What to say about a config.json whose model_type no installed library loads."""
    import fla
    import transformers

    return (f"unknown model_type {model_type!r}: neither a family of the installed fla ({fla.__version__}) nor a "
            f"causal LM of transformers {transformers.__version__}; `ccq-eval models --families` lists what "
            "loads (a family from a newer fla needs that fla installed)")
