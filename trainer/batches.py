"""A loop's own batch source across a resume: a callable or an iterable and its position, and the random streams of
a loop that fetches its batches ahead (docs/design/trainer.md, Batch sources).
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import structlog

from ftsup.store.errors import CheckpointError
from ftsup.trainer import rng

MAX_AHEAD = 8
"""The most fetches ahead whose streams a checkpoint can go back to (a loop fetches one ahead, or two)."""
_TOO_MANY = (
    f"more than {MAX_AHEAD} fetches before the first step are no fetching ahead: checkpoints hold the random streams "
    "as each step ends; wrap only the fetch the loop makes ahead, or evaluate inside the loop"
)
log = structlog.get_logger("ftsup.trainer")


class BatchSourceError(ValueError):
    """The batch source cannot serve the run: it is not one, it ran out, or it holds less than a checkpoint drew."""


class CallableSource:
    """`batches=get_batch`: one call per micro-batch. Its randomness is the rank's global streams, which every
    checkpoint holds, so its position is nothing more than the streams (and the count of calls, for the record)."""

    kind = "callable"

    def __init__(self, fetch: Callable[[], Any]) -> None:
        self._fetch = fetch
        self.calls = 0

    def next(self) -> Any:
        batch = self._fetch()
        self.calls += 1
        return batch

    def position(self) -> dict[str, Any]:
        return {"kind": self.kind, "calls": self.calls}

    def resume(self, saved: Mapping[str, Any]) -> None:
        self.calls = _count(saved, "calls")


class IterableSource:
    """`batches=` an iterable (a DataLoader, an `IterableDataset`, a generator): one item per micro-batch, passes one
    after another (`iter()` again once one runs out). Its position is the pass and the items drawn in it; resumed,
    it is the iterable's own `load_state_dict` when it has one, else the pass drawn again from its start, with the
    streams as they were when it began, up to the position."""

    kind = "iterable"

    def __init__(self, iterable: Any) -> None:
        self._iterable = iterable
        self.stateful = callable(getattr(iterable, "state_dict", None)) and callable(
            getattr(iterable, "load_state_dict", None)
        )
        self.passes = 0  # passes begun
        self.drawn = 0  # items drawn in the current pass
        self._it: Iterator[Any] | None = None
        self._pass_streams: Any = None  # the streams just before the current pass's iter()

    def next(self) -> Any:
        while True:
            it = self._it if self._it is not None else self._begin()
            try:
                item = next(it)
            except StopIteration:
                self._it = None
                if self.drawn == 0:
                    raise BatchSourceError(self._ran_out()) from None
                continue
            self.drawn += 1
            return item

    def _begin(self) -> Iterator[Any]:
        streams = None if self.stateful else rng.capture()
        it = iter(self._iterable)
        if it is self._iterable and self.passes:  # an iterator is drawn once
            raise BatchSourceError(self._ran_out())
        self._it, self._pass_streams = it, streams
        self.passes, self.drawn = self.passes + 1, 0
        return it

    def _ran_out(self) -> str:
        return (
            f"the batch source ran out after {self.drawn} items of pass {self.passes}: an iterator is drawn once "
            "(give an iterable that starts again, such as a DataLoader, or train fewer steps), and an iterable "
            "must yield at least one item a pass"
        )

    def position(self) -> dict[str, Any]:
        saved: dict[str, Any] = {"kind": self.kind, "passes": self.passes, "drawn": self.drawn}
        if self.stateful:
            saved["state"] = self._iterable.state_dict()
        else:
            saved["streams"] = self._pass_streams
        return saved

    def resume(self, saved: Mapping[str, Any]) -> None:
        """Stand where `saved` says. The global streams are left as the replay leaves them: the caller restores the
        checkpoint's next."""
        passes, drawn = _count(saved, "passes"), _count(saved, "drawn")
        if self.stateful and "state" in saved:
            self._iterable.load_state_dict(saved["state"])
            self._it = iter(self._iterable)
            self.passes, self.drawn = passes, drawn
            return
        if passes == 0:
            return
        streams = saved.get("streams")
        if streams is not None:
            rng.restore(streams)
        self._it, self._pass_streams = iter(self._iterable), streams
        self.passes, self.drawn = passes, 0
        for _ in range(drawn):
            try:
                next(self._it)
            except StopIteration:
                raise BatchSourceError(
                    f"the batch source holds {self.drawn} items in pass {passes}, fewer than the {drawn} the "
                    "checkpoint had drawn: is it the same data?"
                ) from None
            self.drawn += 1


def batch_source(batches: Any) -> CallableSource | IterableSource:
    """The source for `Session(batches=...)`: a callable, or anything `iter()` takes."""
    if inspect.isgeneratorfunction(batches):
        raise BatchSourceError("batches= takes the generator, not its function: call it (batches=gen())")
    if callable(batches) and not hasattr(batches, "__iter__"):
        return CallableSource(batches)
    if hasattr(batches, "__iter__") or hasattr(batches, "__getitem__"):
        return IterableSource(batches)
    raise BatchSourceError(
        f"batches= takes a callable that returns a micro-batch or an iterable of micro-batches, not a "
        f"{type(batches).__name__}"
    )


class Streams:
    """Which of a rank's random streams a checkpoint holds, and when a resumed rank gets them back.

    A loop that fetches its batches ahead (the first before its first step, each next one inside the step before)
    has drawn the next step's batch by the end of a step. Its fetches go through `fetching()`: those before the first
    step are how far ahead it is, and a save records the streams as they were before that many fetches, which the
    resumed loop's own fetches before its first step draw again. A resumed rank's streams are put back at its first
    fetch or its first step, whichever comes first (`pending`): draws between the Session's making and then (a fixed
    input made at start-up) are those of a fresh run, as they were in the run resumed.
    """

    def __init__(self) -> None:
        self.ahead: int | None = None
        """Fetches before the first step (at most MAX_AHEAD); None until the first step begins."""
        self._before: collections.deque[Any] = collections.deque(maxlen=MAX_AHEAD)
        self._fetches = 0
        self._restore: Callable[[], None] | None = None

    def pending(self, restore: Callable[[], None]) -> None:
        """What puts the resumed streams (and the source's position) back, at the first fetch or step."""
        self._restore = restore

    def restore_now(self) -> None:
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()

    def fetching(self) -> None:
        """Before each fetch of a function `Session.fetcher` wrapped."""
        self.restore_now()
        if self.ahead is None:
            self._fetches += 1
            self._before.append(rng.capture())
        elif self.ahead:
            self._before.append(rng.capture())

    def started(self) -> None:
        """The first step begins."""
        self.restore_now()
        if self.ahead is None:
            self.ahead = self._fetches if self._fetches <= MAX_AHEAD else 0
            if self.ahead != self._fetches:  # not a loop fetching ahead: an evaluation before it, say
                log.warning("fetches_ahead_unknown", fetches=self._fetches, reason=_TOO_MANY)
            self._before = collections.deque(self._before, maxlen=self.ahead)

    def capture(self) -> Any:
        """The streams a save records: before the fetches ahead, or as they are."""
        if self.ahead and len(self._before) == self.ahead:
            return self._before[0]
        return rng.capture()


def _count(saved: Mapping[str, Any], key: str) -> int:
    value = saved.get(key) if isinstance(saved, Mapping) else None
    if type(value) is not int or value < 0:
        raise CheckpointError(f"the checkpoint's batch source position has no count {key!r}: {saved!r:.200}")
    return value
