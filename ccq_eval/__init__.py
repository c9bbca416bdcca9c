"""ccq-eval: long-context evaluation of linear-attention models with and without CCQ.

Subpackages: `model` (the CCQ operator, the CCQ-GLA / CCQ-Gated-DeltaNet models, their loading,
Triton kernels, fla's CPU backend, CUDA graphs), `harness` (the lm-eval adapter, the runner, the
results store, tasks and corpora) and `analysis` (tables, statistics, figures).

Importing the package has no side effects and loads neither torch nor fla: the model loader and the
lm-eval adapter register the model types when they are used
(`ccq_eval.model.modeling_ccq.prepare_runtime`); `import ccq_eval.model.auto` registers the model
types for transformers users. fla is never patched: the CCQ classes run on CPU through their own
modules.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ccq-eval")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
