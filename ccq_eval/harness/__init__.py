"""The evaluation side: the lm-eval adapter (`adapter`, with `scoring`, `generation` and
`truncation`), the runner (`options` -> `plan` -> `runner` -> `store`, resumable through `resume`;
`archive` makes compact copies for committing),
task registration (`task_registry`) and the bundled corpora (`corpora`).
"""
