"""The embedded checkpoints (registry.json and one folder per model), installed as package data of
`ccq_eval.models` so that ccq_eval.model.registry finds them in a checkout and in a wheel alike."""
