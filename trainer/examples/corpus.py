"""A deterministic text corpus generated on the spot (no downloads), tokenised as bytes: the same bytes everywhere."""

from __future__ import annotations

import random

import torch

_SUBJECTS = "the operator|a rank|the supervisor|every node|the scheduler|a spot instance|the checkpoint".split("|")
_VERBS = "saves|loads|restarts|watches|evicts|shards|commits|verifies|resumes|reports".split("|")
_OBJECTS = "the model|its shard|the optimizer state|a manifest|the loss curve|every step|the data position".split("|")
_TAILS = "before the deadline|after a crash|on fewer devices|without losing a step|in the background|at once".split("|")


def generate(n_bytes: int = 1 << 20, seed: int = 1234) -> torch.Tensor:
    rnd = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        s = f"{rnd.choice(_SUBJECTS)} {rnd.choice(_VERBS)} {rnd.choice(_OBJECTS)}"
        if rnd.random() < 0.5:
            s += " " + rnd.choice(_TAILS)
        s += ". " if rnd.random() < 0.8 else ".\n"
        parts.append(s)
        size += len(s)
    data = "".join(parts).encode()[:n_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


class TokenWindows(torch.utils.data.Dataset):
    """Sample i: its id and `seq_len + 1` tokens starting at i * stride."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int | None = None):
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self.n = (len(tokens) - seq_len - 1) // self.stride + 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        start = i * self.stride
        return i, self.tokens[start : start + self.seq_len + 1]
