"""Triton's interpreter (TRITON_INTERPRET=1), patched once per launch instead of once per device-function call.

The interpreter swaps triton.language's builtins for numpy versions when a kernel launches and restores them
when the launch ends. It repeats that swap on every call of a nested @triton.jit function, although the
launch's swap is still in place: a scan over every member of triton.language per call, most of the run time
of kernels that call small helpers in loops. `install()` skips the repeat inside a launch whose swap covers
the language modules the helper sees; kernels run the same numpy code, only sooner.
"""

from __future__ import annotations

import inspect


class _Nothing:
    def restore(self):
        pass


def install():
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state = {"in_launch": False, "covered": set()}  # the language modules the running launch has swapped

    seen: dict[object, set[int]] = {}  # per function: its module's globals do not change within a run

    def languages(fn) -> set[int]:
        if fn not in seen:
            seen[fn] = {id(value) for value in fn.__globals__.values()
                        if inspect.ismodule(value) and value in (tl, tl.core)}
        return seen[fn]

    def launch_tracked(self, *args, **kwargs):
        state["in_launch"], state["covered"] = True, set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["in_launch"] = False

    def patch_lang_once(fn):
        wanted = languages(fn)
        if state["in_launch"] and state["covered"] and wanted <= state["covered"]:
            return _Nothing()
        scope = patch_lang(fn)
        if state["in_launch"]:
            state["covered"] |= wanted
        return scope

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_tracked
