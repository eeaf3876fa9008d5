"""Guards shared by every patch: version checks, attribute checks, post-import hooks."""
from __future__ import annotations

import importlib.abc
import importlib.metadata
import sys
import threading
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version


class PatchError(RuntimeError):
    """A patch's target is not what the patch was written for."""


def require_version(dist: str, spec: str, what: str) -> str:
    """Return the installed version of `dist`, or fail if it is outside `spec`."""
    try:
        installed = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError as e:
        raise PatchError(f"{what}: {dist} is not installed (written for {dist}{spec})") from e
    # A local suffix such as +cpu does not change the API the patch relies on.
    if Version(Version(installed).public) not in SpecifierSet(spec):
        raise PatchError(f"{what}: written for {dist}{spec}, found {installed}; refusing to patch")
    return installed


def require_attr(obj: Any, name: str, what: str) -> Any:
    if not hasattr(obj, name):
        owner = getattr(obj, "__name__", type(obj).__name__)
        raise PatchError(f"{what}: {owner}.{name} does not exist; the patched code has changed")
    return getattr(obj, name)


_hooks: dict[str, list[Callable[[Any], None]]] = {}
_lock = threading.RLock()


def when_imported(module: str, fn: Callable[[Any], None]) -> None:
    """Run `fn(module)` once `module` is imported (now, if it already is).

    Patching at import time of the target keeps the driver from importing heavy modules it
    never uses, and removes any dependence on import order.
    """
    with _lock:
        if module in sys.modules and getattr(sys.modules[module], "__spec__", None) is not None:
            fn(sys.modules[module])
            return
        _hooks.setdefault(module, []).append(fn)
        if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _PostImportFinder())


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _hooks:
            return None
        # Let the normal finders locate the module, then wrap its loader.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(spec.loader, fullname)
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, inner, fullname):
        self._inner = inner
        self._fullname = fullname

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        with _lock:
            fns = _hooks.pop(self._fullname, [])
        for fn in fns:
            fn(module)

    def __getattr__(self, name):
        return getattr(self._inner, name)
