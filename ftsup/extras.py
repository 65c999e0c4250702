"""Which optional extra of the `ftsup` distribution provides which import, and `MissingExtraError`, which names it.

`trainer` (torch, numpy), `durable` (boto3), `bench` (ft_launcher). Stdlib only; it imports nothing it names.
"""

from __future__ import annotations

import importlib.util
import sys

PROVIDED_BY = {
    "torch": "trainer",
    "numpy": "trainer",
    "nvidia_resiliency_ext": "bench",
    "boto3": "durable",
    "botocore": "durable",
}
"""Top-level import name -> the extra of `ftsup` that installs it (pyproject.toml's optional-dependencies)."""


class MissingExtraError(ModuleNotFoundError):
    """A module that an extra of ftsup installs is missing; the message says which extra and how to install it."""


def needs(error: ModuleNotFoundError, what: str) -> str:
    """The line for a user when `what` (such as "ftsup.TrainingState") failed to import the module `error` names."""
    top = (error.name or "").partition(".")[0] or "a module"
    extra = PROVIDED_BY.get(top)
    fix = f"install ftsup's {extra} extra: pip install 'ftsup[{extra}]'" if extra else f"install {top}"
    return f"{what} needs {top}, which this Python ({sys.executable}) cannot import; {fix}"


def explained(error: ModuleNotFoundError, what: str) -> ModuleNotFoundError:
    """`error` as a `MissingExtraError` when an extra of ftsup provides the module it misses, else `error` itself."""
    top = (error.name or "").partition(".")[0]
    if isinstance(error, MissingExtraError) or top not in PROVIDED_BY:
        return error
    return MissingExtraError(needs(error, what), name=top)


def require(extra: str, what: str) -> None:
    """Raise `MissingExtraError` unless every module of `extra` can be found (found, not imported)."""
    for module, provider in PROVIDED_BY.items():
        if provider == extra and not _found(module):
            raise MissingExtraError(needs(ModuleNotFoundError(name=module), what), name=module)


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module left half-imported
        return False
