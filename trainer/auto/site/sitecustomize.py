"""The ranks' start-up hook under `ftsup run`: Python imports it at start-up from `PYTHONPATH`.

In a rank (torchrun's `LOCAL_RANK` set) it installs the auto-instrumentation's post-import hooks, then runs the
`sitecustomize` it shadows, if any (docs/design/auto-instrumentation.md, Start-up). Nothing here may fail the script.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _instrument() -> None:
    if "LOCAL_RANK" not in os.environ:  # torchrun itself, or a process that is not a rank
        return
    try:
        from ftsup.trainer.auto import startup

        startup.install(HERE)
    except Exception as e:  # ftsup not importable by this interpreter, or broken: the script runs as it is
        try:
            sys.stderr.write(f"warning: ftsup auto-instrumentation is off in this rank: {type(e).__name__}: {e}\n")
        except (OSError, ValueError):
            pass


def _chain() -> None:
    """Run the next `sitecustomize` on sys.path after this directory (a distribution's, a virtual environment's, the
    user's), as Python would have without this one; its errors are its own, as they would have been."""
    here = os.path.realpath(HERE)
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_instrument()
_chain()
