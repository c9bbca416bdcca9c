"""lm-eval task folders (YAML plus small Python hooks), one per family: s_niah, ppl, longbench.

Installed as the package `ccq_eval.tasks` (pyproject.toml maps this folder), so the hooks import as
`ccq_eval.tasks.<family>.utils`; lm-eval includes the family folders (ccq_eval.harness.task_registry)
and loads the hooks their YAML names (`!function utils.<name>`) from them.
"""
