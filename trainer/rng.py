"""Capture and restore every random number stream a rank uses, and seeds derived for what must not depend on the
world size (docs/design/trainer.md, Random streams).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

from ftsup.store.errors import CheckpointError


def capture() -> dict[str, Any]:
    np_state: tuple[Any, ...] = tuple(np.random.get_state())
    state: dict[str, Any] = {
        "python": _python_state_to_json(random.getstate()),
        "numpy": {
            "kind": str(np_state[0]),
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.uint32).copy()),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch_cpu": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def restore(state: dict[str, Any]) -> None:
    try:
        random.setstate(_python_state_from_json(state["python"]))
        n = state["numpy"]
        np.random.set_state(
            (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
        torch.set_rng_state(state["torch_cpu"])
        cuda = state.get("cuda", [])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"saved RNG state is malformed ({type(e).__name__}: {e})") from None
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda):
            raise CheckpointError(
                f"the checkpoint holds RNG state for {len(cuda)} CUDA devices but this rank sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
            )
        for i, s in enumerate(cuda):
            torch.cuda.set_rng_state(s, i)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from the given parts (stable across runs, platforms and world sizes)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def reseed(seed: int, rank: int, step: int) -> None:
    """Fresh streams for a rank that had no saved state (a world size that grew)."""
    s = derive_seed(seed, "rank", rank, "step", step)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def micro_batch_seed(seed: int, step: int, first_sample: int) -> int:
    """The seed of the micro-batch whose first global sample id is `first_sample` at `step`."""
    return derive_seed(seed, "micro", step, first_sample)


def _python_state_to_json(state: tuple[Any, ...]) -> dict[str, Any]:
    version, internal, gauss = state
    return {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def _python_state_from_json(obj: dict[str, Any]) -> tuple[Any, ...]:
    return (obj["version"], tuple(int(x) for x in obj["internal"].tolist()), obj["gauss"])
