"""ccq-eval: long-context evaluation of linear-attention models with and without CCQ.

Importing the package makes fla's GLA / Gated DeltaNet run on CPU (a torch backend chosen by tensor
device; CUDA keeps fla's kernels) and registers the model types ccq_gla and ccq_gated_deltanet with
transformers' Auto classes.
"""

from ccq_eval import autotune as _autotune
from ccq_eval import backend as _backend

_autotune.install_limit_from_env()
_backend.install()

from ccq_eval.modeling_ccq import register as _register_models  # noqa: E402  (after the backend patches fla)

_register_models()

__version__ = "0.1.0"
