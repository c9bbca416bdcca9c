"""`rebind`: a copy of one of fla's functions that looks up some of its global names elsewhere.

The CPU backend runs fla's own layer code with the op names it calls bound to this package's dispatchers,
and the Hopper fix builds fla's backward with a corrected op; both leave fla's functions and modules as
they are.
"""

from __future__ import annotations

import types
from collections.abc import Callable


def rebind(function: Callable, **names: object) -> Callable:
    """A copy of `function` (its code, defaults and closure) that finds `names` in place of the module
    globals of those names; the original function and its module are untouched.

    Every name must be one the function's own code looks up, so that a change in fla (an op renamed, a
    call moved into a helper) fails here, when the copy is made, instead of silently calling fla's op.
    """
    if hasattr(function, "__wrapped__"):
        raise TypeError(f"rebind: {function.__qualname__} is a decorated wrapper; rebind the function it wraps")
    unknown = sorted(set(names) - set(function.__code__.co_names))
    if unknown:
        raise ValueError(
            f"rebind: {function.__module__}.{function.__qualname__} does not look up {unknown}; the installed "
            "fla differs from the one ccq-eval was written against (pyproject.toml pins it)."
        )
    namespace = dict(function.__globals__)
    namespace.update(names)
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__doc__ = function.__doc__
    copy.__module__ = function.__module__
    copy.__annotations__ = dict(function.__annotations__)
    return copy
