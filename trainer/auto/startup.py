"""What a rank's start-up hook installs: post-import hooks for the libraries the auto-instrumentation instruments,
and nothing else until the script imports one of them (docs/design/auto-instrumentation.md, Start-up)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, MutableMapping
from types import ModuleType

from ftsup.trainer.auto import imports
from ftsup.trainer.auto.contain import Piece

# module imported by the script -> (the module of ours that instruments it, its function taking the imported module)
INSTRUMENTED = {
    "torch": ("ftsup.trainer.auto.steps", "instrument"),
    "transformers.trainer": ("ftsup.trainer.auto.hf", "instrument"),
    "lightning.pytorch": ("ftsup.trainer.auto.lightning", "instrument"),
    "pytorch_lightning": ("ftsup.trainer.auto.lightning", "instrument"),
    "deepspeed.runtime.engine": ("ftsup.trainer.auto.deepspeed", "instrument"),
}
PIECES = {name: Piece(f"instrumenting {name}") for name in INSTRUMENTED}
PATH = Piece("leaving PYTHONPATH")


def install(hook_dir: str, environ: MutableMapping[str, str] | None = None) -> None:
    """Watch every module of `INSTRUMENTED`. `hook_dir` (the start-up hook's directory) leaves `PYTHONPATH` in
    `environ` (default: this process's) once torch is imported: the process that trains is instrumented, the
    processes it starts (data loader workers, compile workers, a subprocess) are not."""
    env = os.environ if environ is None else environ
    for name, (module, function) in INSTRUMENTED.items():
        hook = _hook(PIECES[name], module, function)
        if name == "torch":
            hook = _first(lambda _m: PATH.run(leave_path, hook_dir, env), hook)
        imports.when_imported(name, hook)


def _hook(piece: Piece, module: str, function: str) -> Callable[[ModuleType], None]:
    def call(imported: ModuleType) -> None:
        piece.run(lambda: getattr(importlib.import_module(module), function)(imported))

    return call


def _first(before: Callable[[ModuleType], None], then: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def both(imported: ModuleType) -> None:
        before(imported)
        then(imported)

    return both


def leave_path(hook_dir: str, environ: MutableMapping[str, str]) -> None:
    """Take `hook_dir` off `PYTHONPATH` in `environ` (the variable goes when nothing else is left in it)."""
    here = os.path.realpath(hook_dir)
    entries = environ.get("PYTHONPATH", "").split(os.pathsep)
    kept = [e for e in entries if e and os.path.realpath(e) != here]
    if kept:
        environ["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        environ.pop("PYTHONPATH", None)
