"""The launch protocol vLLM 0.30's kernel dispatchers expect from `dispatcher.kernel`."""
from __future__ import annotations

import inspect
from typing import Callable, Iterable

from tlt_verl.patches._guard import PatchError, require_attr


class CpuLaunch:
    """`kernel[grid](**kwargs)` calls `func`; the dispatcher binds its inputs to `func`'s parameter names."""

    def __init__(self, func: Callable) -> None:
        self.func = func

    def __getitem__(self, grid) -> Callable:
        return self.func


def point(module, dispatcher_name: str, launch, what: str, launch_kwargs: Iterable[str] = ()) -> None:
    """Make `module.<dispatcher_name>` launch `launch` (an object with `.func`, e.g. a CpuLaunch).

    The dispatcher passes an input to the kernel only under a matching name (`x`, `x_ptr`, `X`,
    `X_PTR`) and drops the others, so a renamed argument would surface mid-generation as a
    missing parameter. Check here that every required parameter of `func` will be supplied,
    either by a dispatcher input or by one of `launch_kwargs` (what its dispatch spec returns).
    """
    dispatcher = require_attr(module, dispatcher_name, what)
    require_attr(dispatcher, "kernel", what)
    inputs = require_attr(dispatcher, "_dispatch_arg_names", what)
    func = require_attr(launch, "func", what)
    supplied = set(launch_kwargs)
    for name in inputs:
        supplied |= {name, f"{name}_ptr", name.upper(), f"{name}_ptr".upper()}
    missing = [p.name for p in inspect.signature(func).parameters.values()
               if p.default is inspect.Parameter.empty and p.name not in supplied]
    if missing:
        raise PatchError(f"{what}: {dispatcher_name} would not pass {missing} to {func.__name__}; "
                         "the dispatcher or the CPU kernel has changed")
    dispatcher.kernel = launch
    # The dispatcher caches the parameter names of its kernel on first use.
    vars(dispatcher).pop("_kernel_arg_names", None)
