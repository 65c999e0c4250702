"""Post-import hooks: run a function right after a named module has been executed, without importing it first.

Stdlib only: installed at a rank's start-up, before the script imports anything (docs/design/auto-instrumentation.md,
Post-import hooks).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from ftsup.trainer.auto.contain import warn

Callback = Callable[[ModuleType], None]


class PostImportFinder(importlib.abc.MetaPathFinder):
    """A finder first on `sys.meta_path` that finds nothing itself: for a watched name it asks the finders after it,
    and has the loader they found call the watch's callbacks once the module's code has run. Any other name costs
    one dict lookup per import. A module imported already when watched gets its callbacks at once."""

    def __init__(self) -> None:
        self._watches: dict[str, list[Callback]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()  # the names being looked up on this thread (our own find is not ours to hook)

    def watch(self, name: str, callback: Callback) -> None:
        """Call `callback(module)` once `name` has been imported (now, if it has been already)."""
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__spec__", None) is not None and not _initialising(module):
            callback(module)
            return
        with self._lock:
            self._watches.setdefault(name, []).append(callback)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._watches:
            return None
        busy: set[str] = self._local.__dict__.setdefault("busy", set())
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            spec = _find_after(self, fullname, path, target)
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None or not _hookable(spec.loader):
            return spec
        with self._lock:
            callbacks = self._watches.pop(fullname, [])
        if callbacks:
            _chain_exec(spec.loader, fullname, callbacks)
        return spec


def _find_after(
    me: PostImportFinder, fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> importlib.machinery.ModuleSpec | None:
    """The spec the finders after `me` on `sys.meta_path` give (as the import system would ask them)."""
    finders = list(sys.meta_path)
    start = next((i for i, f in enumerate(finders) if f is me), -1) + 1
    for finder in finders[start:]:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec  # type: ignore[no-any-return]
    return None


def _hookable(loader: Any) -> bool:
    """A loader object of its own with `exec_module`: its instance attribute can be set (never a class's)."""
    return not isinstance(loader, type) and hasattr(loader, "exec_module") and hasattr(loader, "__dict__")


def _chain_exec(loader: Any, fullname: str, callbacks: list[Callback]) -> None:
    """Have `loader.exec_module` call `callbacks` after it ran the module `fullname` (the loader may be shared by
    several modules, as a zip importer is: only that module's execution calls them, once)."""
    original = loader.exec_module

    def exec_module(module: ModuleType) -> None:
        original(module)
        if module.__name__ != fullname:
            return
        try:
            del loader.exec_module  # back to the class's method: the next module of this loader is not ours
        except AttributeError:
            pass
        for callback in callbacks:
            try:
                callback(module)
            except Exception as e:  # never the import's failure: the module is there, only its hook is lost
                warn(f"a hook on {fullname} failed ({type(e).__name__}: {e})")

    loader.exec_module = exec_module


def _initialising(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


_finder: PostImportFinder | None = None


def finder() -> PostImportFinder:
    """The process's finder, first on `sys.meta_path` (put there at the first call)."""
    global _finder
    if _finder is None:
        _finder = PostImportFinder()
        sys.meta_path.insert(0, _finder)
    return _finder


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` once the module `name` has been imported: now when it has, else right after its code
    has run (before the statement that imported it goes on)."""
    finder().watch(name, callback)
