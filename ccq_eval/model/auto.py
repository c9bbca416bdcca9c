"""`import ccq_eval.model.auto` registers the CCQ model types (`ccq_gla`, `ccq_gated_deltanet`) with
transformers' AutoConfig and AutoModelForCausalLM, as importing fla's models registers theirs; then
`AutoModelForCausalLM.from_pretrained("models/tiny-gla-ccq")` builds the CCQ class. Without it
transformers does not know the model type and says so ("does not recognize this architecture").

A module of its own, so that importing `ccq_eval` or `ccq_eval.model` (the registry, which read-only
commands use) stays free of torch, fla and transformers.
"""

from ccq_eval.model.modeling_ccq import register

register()
