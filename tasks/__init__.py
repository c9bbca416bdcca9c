"""lm-eval task folders (YAML plus small Python hooks), one per family: s_niah, ppl, longbench.

lm-eval loads the hooks by path (`!function utils.<name>`); from the repository root they are also
importable as `tasks.<family>.utils`, which is how the tests and benchmarks use them.
"""
