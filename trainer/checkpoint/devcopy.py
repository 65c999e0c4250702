"""A save's copy from GPU memory to the host: launched on a side stream, never waited for by the caller's thread.

Into page-locked buffers registered once and reused (`HostBuffers`); the writer thread waits on the copies' event
(`Copies.landed`), the training stream waits on it on the device before the next optimizer step (`UpdateFence`).
Why so: trainer/checkpoint/DESIGN.md, "Staging on a GPU"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import torch

from ftsup.trainer.checkpoint.shardio import PAGE, aligned_buffer, round_up

log = structlog.get_logger("ftsup.checkpoint")

_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process


class Copies:
    """One save's copies in flight: an event per device, and their sources, held until the copies have landed (a
    source freed meanwhile, a temporary of the state dict, could be reused by the training stream while the side
    stream still reads it)."""

    def __init__(self, events: dict[int, torch.cuda.Event], sources: list[torch.Tensor]) -> None:
        self.events = events
        self._sources: list[torch.Tensor] = sources

    def landed(self) -> None:
        """Block until every copy has landed, then let go of the sources. The writer thread's wait: the caller of
        `save()` never blocks here."""
        for event in self.events.values():
            event.synchronize()
        self._sources = []

    def done(self) -> bool:
        """True once every copy has landed (asks the driver; waits for nothing)."""
        return all(event.query() for event in self.events.values())

    def fence(self) -> None:
        """Make each device's current stream wait for the copies: a wait on the device, the host goes on."""
        for index, event in self.events.items():
            torch.cuda.current_stream(index).wait_event(event)


class SideStreams:
    """One copy stream per device, made on first use and kept."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}

    def launch(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Copies:
        """Copy each (host destination, CUDA source) on its device's side stream, after the work already queued on
        that device's current stream (so the copy holds the values of this moment)."""
        by_device: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for dst, src in pairs:
            index = src.device.index if src.device.index is not None else torch.cuda.current_device()
            dsts, srcs = by_device.setdefault(index, ([], []))
            dsts.append(dst)
            srcs.append(src)
        events: dict[int, torch.cuda.Event] = {}
        for index, (dsts, srcs) in by_device.items():
            side = self._streams.get(index)
            if side is None:
                side = self._streams[index] = torch.cuda.Stream(index)
            side.wait_stream(torch.cuda.current_stream(index))
            with torch.cuda.stream(side):
                _copy_all(dsts, srcs)
                events[index] = side.record_event()
        return Copies(events, [src for _, src in pairs])


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    # One call for the whole list (torch loops in C++); per tensor where a torch build refuses a list across devices.
    try:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
    except (RuntimeError, NotImplementedError):
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src, non_blocking=True)


class HostBuffers:
    """Page-locked staging buffers: page-aligned anonymous mappings (`aligned_buffer`: huge pages, populated up
    front) registered with CUDA once, of exactly the size asked for (torch's pinned allocator rounds up to a power of
    two), until `drop` or `close`. Where registering fails, torch's pinned allocator gives the buffer."""

    def __init__(self) -> None:
        self._registered: dict[int, torch.Tensor] = {}
        self._torch_pinned: dict[int, torch.Tensor] = {}

    def allocate(self, nbytes: int) -> torch.Tensor:
        buf = aligned_buffer(nbytes)
        status = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), round_up(max(nbytes, 1), PAGE), _PORTABLE))
        if status == 0:
            self._registered[buf.data_ptr()] = buf
            return buf
        log.warning("checkpoint_host_register_failed", nbytes=nbytes, reason=f"cudaHostRegister returned {status}")
        buf = aligned_buffer(nbytes, pin=True)
        self._torch_pinned[buf.data_ptr()] = buf
        return buf

    def holds(self, buf: torch.Tensor) -> bool:
        """True when `buf` is one of these page-locked buffers."""
        return buf.data_ptr() in self._registered or buf.data_ptr() in self._torch_pinned

    def drop(self, buf: Any) -> None:
        """Unregister `buf` (no copy may be in flight into it); anything else is left as it is."""
        if buf is None:
            return
        self._torch_pinned.pop(buf.data_ptr(), None)
        if self._registered.pop(buf.data_ptr(), None) is not None:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def close(self) -> None:
        for buf in list(self._registered.values()) + list(self._torch_pinned.values()):
            self.drop(buf)


class UpdateFence:
    """The next optimizer step waits for the copies in flight: a pre-hook of every torch optimizer's `step()`
    (installed with the first copies, removed by `close`) makes the current stream wait for their events, on the
    device. `fence()` does the same by hand, for whatever else writes the saved tensors in place before then."""

    def __init__(self) -> None:
        self._pending: list[Copies] = []
        self._hook: Any = None

    def arm(self, copies: Copies) -> None:
        self._pending = [c for c in self._pending if not c.done()] + [copies]
        if self._hook is None:
            self._hook = torch.optim.optimizer.register_optimizer_step_pre_hook(self._before_step)

    def fence(self) -> None:
        pending, self._pending = self._pending, []
        for copies in pending:
            copies.fence()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.fence()

    def close(self) -> None:
        self._pending = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
