"""`ftsup.Session` with a loop's own batches: a callable, iterables (drawn again from their pass's start, or restored
from their own `state_dict`) and a loop that fetches ahead through `fetcher` each resume from a periodic checkpoint
bitwise as the uninterrupted run went on, in one process, and on two ranks (`tests/bin/source_job.py` under torchrun)
the rank the checkpoint had keeps its streams; steps numbered from 0; the default store; a phase as a decorator; the
refusals. Every model has dropout, so a resumed random stream that is off shows in the losses.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from torch import nn

from ftsup import Session
from ftsup.protocol import CHECKPOINT_DIR_ENV, RuntimeEnv
from ftsup.store import layout
from ftsup.store.errors import CheckpointMismatchError
from ftsup.trainer import rng
from ftsup.trainer.batches import MAX_AHEAD, BatchSourceError
from ftsup.trainer.data import DataConfigError
from ftsup.trainer.runtime import RuntimeClient, install, runtime
from tests.procs import BIN, run

STEPS, SAVE_EVERY, RESUME_AT = 8, 3, 3
DATA = torch.randn(10, 4, generator=torch.Generator().manual_seed(1))


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # what a script does first: the same weights and streams in every run
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def randn_batch() -> torch.Tensor:
    return torch.randn(3, 4)  # random sampling from the global generator, as torch.randint windows are


def first(item: Any) -> torch.Tensor:
    return item[0] if isinstance(item, (list, tuple)) else item


def train(session: Session, total: int = STEPS) -> dict[int, str]:
    """The session's loop to `total`: each step's summed loss as float.hex."""
    optimizer = session.state.optimizer
    losses = {}
    for step in session.steps(total):
        summed = torch.zeros(())
        for item in session.micro_batches():
            loss = session.model(first(item)).pow(2).mean()
            (loss / session.accumulation_steps).backward()
            summed += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = float(summed).hex()
    return losses


def uninterrupted_and_resumed(tmp: Path, run: Callable[[Path], dict[int, str]]) -> tuple[dict, dict]:
    """`run` to the end in one store; then again in another holding only the first's checkpoint of RESUME_AT."""
    full = run(tmp / "full")
    saved = layout.step_dirname(RESUME_AT)
    shutil.copytree(tmp / "full" / saved, tmp / "resumed" / saved)
    resumed = run(tmp / "resumed")
    return {s: h for s, h in full.items() if s > RESUME_AT}, resumed


def test_a_callable_drawing_from_the_global_generator_resumes_bitwise(tmp_path):
    def run(store: Path) -> dict[int, str]:
        model, optimizer = model_and_optimizer()
        session = Session(model, optimizer, batches=randn_batch, accumulation_steps=2, ckpt_dir=store, save_every=3)
        return train(session)

    full, resumed = uninterrupted_and_resumed(tmp_path, run)
    assert (sorted(resumed), resumed) == (list(range(RESUME_AT + 1, STEPS + 1)), full)


def shuffled(workers: int) -> Callable[[], Any]:
    # 5 micro-batches a pass, 2 a step: the checkpoint of step 3 stands in the second pass, whose order the
    # DataLoader drew from the global generator when the pass began.
    data = torch.utils.data.TensorDataset(DATA)
    return lambda: torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, num_workers=workers)


def noisy() -> Iterator[torch.Tensor]:
    for i in range(1000):  # an iterator: the resumed script makes a new one, which is advanced
        yield DATA[i % 10 : i % 10 + 1] + torch.randn(1, 4)  # per-item randomness from the global generator


@pytest.mark.parametrize(
    "make", [shuffled(0), shuffled(2), noisy], ids=["dataloader", "dataloader-2-workers", "generator-drawing-randn"]
)
def test_an_iterable_is_drawn_again_from_its_pass_and_resumes_bitwise(tmp_path, make):
    def run(store: Path) -> dict[int, str]:
        model, optimizer = model_and_optimizer()
        session = Session(model, optimizer, batches=make(), accumulation_steps=2, ckpt_dir=store, save_every=3)
        return train(session)

    full, resumed = uninterrupted_and_resumed(tmp_path, run)
    assert resumed == full


class ShuffleBuffer:
    """An in-process shuffle buffer: it holds 4 items and yields one that torch's global generator picks."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        buffer: list[torch.Tensor] = []
        taken = 0
        while True:
            while len(buffer) < 4:
                buffer.append(DATA[taken % 10 : taken % 10 + 1])
                taken += 1
            yield buffer.pop(int(torch.randint(len(buffer), ())))


def test_a_source_carrying_state_built_from_the_global_streams_resumes_with_other_items(tmp_path):
    # Drawn again without the dropout draws between its items, the buffer holds other items than it did.
    def run(store: Path) -> dict[int, str]:
        model, optimizer = model_and_optimizer()
        session = Session(model, optimizer, batches=ShuffleBuffer(), accumulation_steps=2, ckpt_dir=store, save_every=3)
        return train(session)

    full, resumed = uninterrupted_and_resumed(tmp_path, run)
    assert (sorted(resumed), resumed != full) == (sorted(full), True)


class Stream:
    """An iterable with its own state: item i is DATA[i % 10] scaled by its pass; it counts what it yields."""

    def __init__(self) -> None:
        self.pos, self.passes, self.yielded = 0, 0, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.passes += 1
        while self.pos < 7:
            self.pos += 1
            self.yielded += 1
            yield DATA[self.pos % 10 : self.pos % 10 + 1] * self.passes
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos, "passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos, self.passes = state["pos"], state["passes"] - 1  # __iter__ counts the pass it resumes


def test_an_iterable_with_a_state_dict_is_restored_from_it_not_drawn_again(tmp_path):
    streams = []

    def run(store: Path) -> dict[int, str]:
        model, optimizer = model_and_optimizer()
        streams.append(Stream())
        session = Session(model, optimizer, batches=streams[-1], accumulation_steps=2, ckpt_dir=store, save_every=3)
        return train(session)

    full, resumed = uninterrupted_and_resumed(tmp_path, run)
    assert (resumed, streams[1].yielded) == (full, 2 * (STEPS - RESUME_AT))


def fetching_ahead(store: Path, *, wrap: bool, fixed: list[str] | None = None) -> dict[int, str]:
    """nanoGPT's loop: the first batch fetched before the loop, each next one in the micro-step before."""
    model, optimizer = model_and_optimizer()
    session = Session(model, optimizer, ckpt_dir=store, save_every=3)
    get_batch = session.fetcher(randn_batch) if wrap else randn_batch
    if fixed is not None:
        fixed.append(float(torch.randn(2, 4).sum()).hex())  # an input made at start-up
    x = get_batch()
    losses = {}
    for step in session.steps(STEPS):
        summed = torch.zeros(())
        for _ in range(2):
            loss = model(x).pow(2).mean()
            x = get_batch()
            (loss / 2).backward()
            summed += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = float(summed).hex()
    return losses


def fetching_in_step(store: Path) -> dict[int, str]:
    """A loop that draws each batch in the step that trains on it, with no wrapper: the docs' own-batches snippet."""
    model, optimizer = model_and_optimizer()
    session = Session(model, optimizer, ckpt_dir=store, save_every=3)
    losses = {}
    for step in session.steps(STEPS):
        loss = model(randn_batch()).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = float(loss.detach()).hex()
    return losses


def test_a_loop_drawing_its_own_batches_in_the_step_resumes_bitwise_with_nothing_handed_over(tmp_path):
    full, resumed = uninterrupted_and_resumed(tmp_path, fetching_in_step)
    assert resumed == full


def test_a_loop_that_fetches_ahead_through_fetcher_resumes_bitwise(tmp_path):
    full, resumed = uninterrupted_and_resumed(tmp_path, lambda store: fetching_ahead(store, wrap=True))
    assert resumed == full


def test_without_fetcher_a_loop_that_fetches_ahead_resumes_with_other_batches(tmp_path):
    full, resumed = uninterrupted_and_resumed(tmp_path, lambda store: fetching_ahead(store, wrap=False))
    assert sorted(resumed) == sorted(full)
    assert resumed != full


def test_what_a_resumed_script_draws_before_its_first_fetch_is_what_a_fresh_run_drew(tmp_path):
    fixed: list[str] = []
    full, resumed = uninterrupted_and_resumed(tmp_path, lambda store: fetching_ahead(store, wrap=True, fixed=fixed))
    assert (resumed, fixed[0]) == (full, fixed[1])


def test_more_fetches_before_the_first_step_than_a_loop_makes_ahead_are_warned_of(tmp_path):
    model, optimizer = model_and_optimizer()
    session = Session(model, optimizer, ckpt_dir=tmp_path, save_every=None)
    get_batch = session.fetcher(randn_batch)
    for _ in range(MAX_AHEAD + 1):  # an evaluation before the loop, through the wrapped function
        get_batch()
    with structlog.testing.capture_logs() as logs:
        for _ in session.steps(1):
            pass
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["fetches_ahead_unknown"]


def test_steps_numbered_from_0_resume_at_the_number_after_the_checkpoints(tmp_path):
    def numbers(store: Path) -> list[int]:
        model, optimizer = model_and_optimizer()
        return list(Session(model, optimizer, ckpt_dir=store, save_every=2).steps(5, first=0))

    full = numbers(tmp_path / "full")
    shutil.copytree(tmp_path / "full" / layout.step_dirname(2), tmp_path / "resumed" / layout.step_dirname(2))
    assert (full, numbers(tmp_path / "resumed")) == ([0, 1, 2, 3, 4], [2, 3, 4])


def test_without_a_named_store_checkpoints_go_to_dot_ftsup_checkpoints_which_git_ignores(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert runtime().env.checkpoint_dir is None  # no FTSUP_CHECKPOINT_DIR here
    model, optimizer = model_and_optimizer()
    train(Session(model, optimizer, batches=randn_batch, save_every=2), 3)
    steps = [c.step for c in layout.list_checkpoints(tmp_path / ".ftsup" / "checkpoints")]
    assert (steps, (tmp_path / ".ftsup" / ".gitignore").read_text().splitlines()[-1]) == ([2, 3], "*")


class Recording(RuntimeClient):
    """A client without a supervisor that keeps each (step, phase) it was asked to beat."""

    def __init__(self) -> None:
        super().__init__(runtime().env)
        self.beats: list[tuple[int, str]] = []

    def beat(self, step: int, phase: Any = None, **figures: Any) -> None:
        self.beats.append((step, str(phase)))
        super().beat(step, phase, **figures)


@pytest.fixture
def recording() -> Iterator[Recording]:
    before = runtime()
    client = Recording()
    install(client)
    try:
        yield client
    finally:
        install(before)


def test_a_phase_decorating_a_function_enters_the_phase_at_each_call_with_that_calls_step(tmp_path, recording):
    model, optimizer = model_and_optimizer()
    session = Session(model, optimizer, ckpt_dir=tmp_path, save_every=None)

    @session.phase("eval")
    def evaluate() -> None:
        pass

    for step in session.steps(4):
        if step % 2 == 0:
            evaluate()  # in the step's body: the steps completed are the ones before it
    assert [b for b in recording.beats if b[1] == "eval"] == [(1, "eval"), (3, "eval")]


def test_keepalive_beats_once_in_phase_eval_at_the_steps_completed(tmp_path, recording):
    model, optimizer = model_and_optimizer()
    session = Session(model, optimizer, ckpt_dir=tmp_path, save_every=None)
    for step in session.steps(2):
        if step == 2:
            session.keepalive()
    assert [b for b in recording.beats if b[1] == "eval"] == [(1, "eval")]


def test_a_loop_left_by_break_has_its_save_in_flight_committed_by_close(tmp_path):
    model, optimizer = model_and_optimizer()
    session = Session(model, optimizer, batches=randn_batch, ckpt_dir=tmp_path, save_every=2)
    for step in session.steps(STEPS):
        if step == 3:  # step 2's periodic save was started when the loop asked for step 3
            break
    session.close()
    assert [c.step for c in layout.list_checkpoints(tmp_path)] == [2]


def dataset_session(store: Path) -> Session:
    model, optimizer = model_and_optimizer()
    return Session(model, optimizer, None, list(DATA), global_batch=2, micro_batch=2, ckpt_dir=store, save_every=1)


def test_a_checkpoint_of_a_dataset_session_is_refused_by_a_batch_source_session_naming_the_keys(tmp_path):
    train(dataset_session(tmp_path), 1)
    model, optimizer = model_and_optimizer()
    with pytest.raises(CheckpointMismatchError) as refused:
        Session(model, optimizer, batches=randn_batch, ckpt_dir=tmp_path)
    assert (refused.value.keys[0], refused.value.keys[-1]) == ("global_batch", "batch_source")


def test_data_skips_from_the_supervisor_are_logged_as_not_applied_to_a_batch_source(tmp_path):
    before = runtime()
    install(RuntimeClient(RuntimeEnv(data_skips=((0, 4),))))
    try:
        model, optimizer = model_and_optimizer()
        with structlog.testing.capture_logs() as logs:
            Session(model, optimizer, batches=randn_batch, ckpt_dir=tmp_path).close()
    finally:
        install(before)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["data_skips_not_applied"]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"batches": randn_batch, "global_batch": 4}, "batches= is the loop's own source"),
        ({"accumulation_steps": 2}, "give it with batches="),
        ({"batches": randn_batch, "skip": [(0, 4)]}, "skip= needs a map-style dataset"),
        ({"batches": randn_batch, "accumulation_steps": 0}, "accumulation_steps must be a number >= 1"),
        ({"batches": 3}, "batches= takes a callable"),
    ],
)
def test_data_arguments_that_do_not_go_together_are_refused_naming_why(tmp_path, kwargs, words):
    model, optimizer = model_and_optimizer()
    with pytest.raises((DataConfigError, BatchSourceError), match=words):
        Session(model, optimizer, ckpt_dir=tmp_path, **kwargs)


def test_an_iterator_that_runs_out_is_an_error_naming_what_to_give(tmp_path):
    model, optimizer = model_and_optimizer()
    session = Session(model, optimizer, batches=iter(list(DATA[:3])), accumulation_steps=2, ckpt_dir=tmp_path)
    with pytest.raises(BatchSourceError, match="an iterator is drawn once"):
        train(session, 2)
    session.close()


def test_a_loop_without_a_batch_source_is_told_that_micro_batches_needs_one(tmp_path):
    model, optimizer = model_and_optimizer()
    session = Session(model, optimizer, ckpt_dir=tmp_path)
    with pytest.raises(RuntimeError, match="needs batches= or a dataset"):
        for _ in session.steps(1):
            next(session.micro_batches())
    session.close()


def batches(record: Path) -> dict[int, str]:
    return {j["step"]: j["batch_hex"] for j in map(json.loads, record.read_text().splitlines())}


@pytest.mark.multiprocess
def test_on_two_ranks_the_rank_the_checkpoint_had_keeps_its_streams_and_the_new_one_gets_its_own(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=0"]
    for store, nproc in ((one, 1), (two, 2)):
        if store == two:
            shutil.copytree(one / layout.step_dirname(RESUME_AT), two / layout.step_dirname(RESUME_AT))
        argv = [*launch, f"--nproc-per-node={nproc}", str(BIN / "source_job.py"), "--steps", "5"]
        r = run([*argv, "--record", str(store / "rank{rank}.jsonl")], env={CHECKPOINT_DIR_ENV: str(store)})
        assert r.returncode == 0, r.output[-3000:]
    rng.reseed(0, 1, RESUME_AT)  # what rank 1, which the checkpoint did not have, starts from: (seed, rank, step)
    new_rank = float(torch.randn(3, 4).sum()).hex()
    kept = {s: h for s, h in batches(one / "rank0.jsonl").items() if s > RESUME_AT}
    assert (batches(two / "rank0.jsonl"), batches(two / "rank1.jsonl")[RESUME_AT + 1]) == (kept, new_rank)
