"""A bounded collective timeout for a script that sets none: `init_process_group` and `new_group` called without a
`timeout` get the one `ftsup run` exports (`heartbeat.collective_timeout_s`; docs/design/auto-instrumentation.md)."""

from __future__ import annotations

import datetime
import functools
import inspect
import math
import os
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from ftsup.protocol import COLLECTIVE_TIMEOUT_ENV
from ftsup.trainer.auto.contain import Piece

TIMEOUT = Piece("the default collective timeout")


def install(torch: ModuleType, timeout_s: float | None = None) -> None:
    """Wrap `torch.distributed.init_process_group` and `new_group` (both where the script finds them, the package
    and `distributed_c10d`) so that a call without a timeout gets `timeout_s` (default: the environment's)."""
    TIMEOUT.run(_install, torch, timeout_s)


def _install(torch: ModuleType, timeout_s: float | None) -> None:
    seconds = collective_timeout_s() if timeout_s is None else timeout_s
    dist = getattr(torch, "distributed", None)
    if seconds is None or dist is None or not dist.is_available():
        return
    c10d = dist.distributed_c10d
    for name in ("init_process_group", "new_group"):
        original = getattr(c10d, name)
        wrapped = with_default_timeout(original, datetime.timedelta(seconds=seconds))
        for module in (dist, c10d):
            if getattr(module, name, None) is original:
                setattr(module, name, wrapped)


def collective_timeout_s(env: Mapping[str, str] | None = None) -> float | None:
    """COLLECTIVE_TIMEOUT_ENV (default: this process's environment; read here, its one reader): the timeout in
    seconds for collectives that the script gives none, or None; ValueError naming the variable when it is not a
    positive number."""
    raw = (os.environ if env is None else env).get(COLLECTIVE_TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else None
    except ValueError:
        value = math.nan
    if value is not None and not 0 < value < math.inf:
        raise ValueError(f"environment variable {COLLECTIVE_TIMEOUT_ENV}={raw!r} is not a positive number of seconds")
    return value


def with_default_timeout(function: Callable[..., Any], timeout: datetime.timedelta) -> Callable[..., Any]:
    """`function` with `timeout` as its `timeout` argument whenever a call gives none (or None)."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        given = TIMEOUT.run(_with_timeout, signature, timeout, args, kwargs)
        if given is not None:
            args, kwargs = given
        return function(*args, **kwargs)

    return call


def _with_timeout(
    signature: inspect.Signature, timeout: datetime.timedelta, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:  # the script's own mistake: the call goes as it came, for torch to say so
        return None
    if bound.arguments.get("timeout") is not None:
        return None
    bound.arguments["timeout"] = timeout
    return bound.args, bound.kwargs
