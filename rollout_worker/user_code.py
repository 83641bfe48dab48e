"""User code a task names, ``module:function`` or a built-in name: a reward or an environment.

One loader for both (``load_function``): the worker calls it for each task's reward and
environment, ``centerline up`` calls it before anything starts, from the directory the workers
will run in (``centerline/up/user_task.py``), so a name that would fail in a worker stops the run
at once with the same message.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Mapping


def load_function(
    kind: str, spec: str, builtins: Mapping[str, Callable], error: type[Exception], *, coroutine: bool = False
) -> Callable:
    """The function ``spec`` names: a key of ``builtins``, or ``module:function``. ``kind`` ("reward",
    "environment") names it in the message of ``error``; ``coroutine``: it must be an ``async def``."""
    if spec in builtins:
        return builtins[spec]
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise error(f"{kind} {spec!r} is neither a built-in ({', '.join(sorted(builtins))}) nor 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # noqa: BLE001 (ImportError, AttributeError, or whatever the module raised)
        raise error(
            f"{kind} {spec!r} cannot be loaded: {type(exc).__name__}: {exc}; is the module on the worker's "
            "PYTHONPATH (the directory `centerline up` runs in)?"
        ) from None
    if coroutine and not asyncio.iscoroutinefunction(fn):
        raise error(f"{kind} {spec!r} is not an async function: write `async def {attr}(client, task) -> float`")
    if not callable(fn):
        raise error(f"{kind} {spec!r} is not callable")
    return fn
