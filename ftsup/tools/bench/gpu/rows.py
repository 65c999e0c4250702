"""One state size's GPU rows in a process of its own: ftsup's save against DCP's `async_save` with pinned staging and
`torch.save`, the raw write under them, the resumes (docs/gpu.md, "What each row means"). Each measurement is appended
to `--out` as a JSON line when taken, so a process stopped at its deadline leaves what it measured. Run by
`tests/gpu/run.sh`: `python -m ftsup.tools.bench.gpu.rows --gb 12 --label 12GB --dir D --out OUT/rows.jsonl`."""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from ftsup.store import blocksum
from ftsup.tools.bench.checkpoint import probes
from ftsup.tools.bench.checkpoint.peer_rows import DirectIOUnsupported, write_file
from ftsup.tools.bench.gpu import contenders
from ftsup.tools.bench.gpu.workload import Workload, fingerprint, state_bytes

# The share of a size's time each row may take, in the order they run (what matters most first).
WEIGHTS = {"ftsup_async": 3, "ftsup_resume": 1, "dcp_async": 3, "dcp_resume": 1, "raw_write": 1, "torch_save": 2}
BASELINE_STEPS = 5
FIRST_STEPS = 3  # the steps after a save call whose extra time is `stall_first_s`
MAX_WINDOW_S = 60.0  # at most this long training during one save; then its end is waited for without steps


class Recorder:
    """Appends one JSON object per line to the output, flushed as written."""

    def __init__(self, out: TextIO, size: str, device: str) -> None:
        self._out = out
        self.base = {"size": size, "device": device}

    def write(self, kind: str, name: str, **fields: Any) -> None:
        self._out.write(json.dumps({"kind": kind, "name": name, **self.base, **fields}) + "\n")
        self._out.flush()


class Budget:
    """Each row's end: its weight's share of the time left before the deadline when it starts."""

    def __init__(self, deadline: float, names: list[str]) -> None:
        self.deadline = deadline
        self.left = list(names)

    def end_of(self, name: str) -> float:
        weights = sum(WEIGHTS[n] for n in self.left)
        self.left.remove(name)
        return time.time() + max(0.0, self.deadline - time.time()) * WEIGHTS[name] / weights


def _steps(w: Workload, n: int) -> float:
    """The median wall time of `n` training steps, the device drained before and after."""
    w.sync()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        w.step()
        times.append(time.perf_counter() - t)
    w.sync()
    return statistics.median(times)


def timed_save(w: Workload, saver: Any, step: int, sd: dict[str, Any], base: float) -> dict[str, Any]:
    """One save while training goes on: its blocked time, and the extra time of the steps from its call until it is
    durable (at least FIRST_STEPS of them), against `base` per step."""
    w.sync()
    t0 = time.perf_counter()
    durable_wait, gate = saver.save(sd, step)
    block = time.perf_counter() - t0
    w.before_update = gate
    waiter = probes.Waiter(durable_wait, t0)
    n, first = 0, None
    while n < FIRST_STEPS or (not waiter.done() and time.perf_counter() - t0 < MAX_WINDOW_S):
        w.step()
        n += 1
        if n == FIRST_STEPS:
            w.sync()
            first = time.perf_counter() - t0 - n * base
    w.sync()
    window = time.perf_counter() - t0
    durable = waiter.join(600.0)
    w.before_update = None
    return {
        "block_s": block,
        "stall_s": window - n * base,
        "stall_first_s": first,
        "steps_during": n,
        "baseline_step_s": base,
        "durable_s": durable,
        "window_s": window,
    }


def save_row(w: Workload, rec: Recorder, saver: Any, end: float, repeats: int, nbytes: int) -> tuple[int, Any] | None:
    """A first save (buffers made, plans cached), then repeats while the row's time lasts; (last step, fingerprint of
    the state it saved) for the resume row, or None when no save was measured."""
    last: tuple[int, Any] | None = None
    took = 0.0
    for i in range(repeats + 1):
        if i > 0 and time.time() + took * 1.2 > end:
            rec.write("skipped", saver.name, reason=f"out of time after {i - 1} repeats", repeats_done=i - 1)
            break
        started = time.time()
        if last is not None:  # one checkpoint on the disk at a time: the last one stays for the resume row
            contenders.remove(saver.path(last[0]))
        base = _steps(w, BASELINE_STEPS)
        t0 = time.perf_counter()
        sd = w.state_dict()
        state_dict_s = time.perf_counter() - t0
        fp = fingerprint(sd)
        step = i + 1
        row = timed_save(w, saver, step, sd, base)
        rec.write(
            "row",
            saver.name,
            repeat="first" if i == 0 else i,
            bytes=nbytes,
            state_dict_s=state_dict_s,
            gb_per_s=nbytes / row["durable_s"] / 1e9 if row["durable_s"] else None,
            **row,
        )
        last = (step, fp)
        took = time.time() - started
    return last


def resume_row(
    w: Workload, rec: Recorder, saver: Any, name: str, saved: tuple[int, Any], end: float, repeats: int, nbytes: int
) -> None:
    """Loads of the last checkpoint into the live state, each checked against the fingerprint taken at its save."""
    step, fp = saved
    took = 0.0
    for i in range(repeats):
        if i > 0 and time.time() + took * 1.2 > end:
            rec.write("skipped", name, reason=f"out of time after {i} repeats", repeats_done=i)
            break
        started = time.time()
        w.step()  # the state moves on from the checkpoint's
        sd = w.state_dict()
        w.sync()
        t0 = time.perf_counter()
        saver.load(sd, step)
        w.sync()
        load_s = time.perf_counter() - t0
        exact = fingerprint(w.state_dict()) == fp
        rec.write("row", name, repeat=i + 1, load_s=load_s, exact=exact, bytes=nbytes, gb_per_s=nbytes / load_s / 1e9)
        took = time.time() - started


def raw_write_row(rec: Recorder, directory: Path, nbytes: int, end: float, repeats: int) -> None:
    """Sequential 64 MiB writes of `nbytes` into one new file of the same directory, fsynced (O_DIRECT where the
    filesystem takes it): what the disk under the checkpoints does at best."""
    directory.mkdir(parents=True, exist_ok=True)
    buf = mmap.mmap(-1, 64 * 2**20)
    buf.write(bytes(range(256)) * (len(buf) // 256))
    direct = True
    took = 0.0
    for i in range(repeats):
        if i > 0 and time.time() + took * 1.2 > end:
            rec.write("skipped", "raw_write", reason=f"out of time after {i} repeats", repeats_done=i)
            break
        path = directory / f"raw-{i}"
        started = time.time()
        try:
            seconds = write_file(path, nbytes, direct, buf)
        except DirectIOUnsupported:
            direct = False
            contenders.remove(path)
            seconds = write_file(path, nbytes, direct, buf)
        contenders.remove(path)
        rec.write(
            "row",
            "raw_write",
            repeat=i + 1,
            durable_s=seconds,
            bytes=nbytes,
            gb_per_s=nbytes / seconds / 1e9,
            o_direct=direct,
        )
        took = time.time() - started


def fstype(path: Path) -> str:
    """The filesystem type under `path` (the longest mount point in /proc/mounts that holds it)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and str(path).startswith(parts[1].rstrip("/") + "/") and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def _free_memory() -> None:
    """What a row kept is given back before the next (GPU memory, page-locked host memory)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    base_dir = Path(args.dir)
    with open(args.out, "a", buffering=1) as out:
        rec = Recorder(out, args.label, device.type)
        w = Workload(int(args.gb * 1e9), args.d, args.tokens, device)
        nbytes, tensors = state_bytes(w.state_dict())
        rec.write(
            "info",
            "setup",
            state_bytes=nbytes,
            tensors=tensors,
            blocks=w.blocks,
            d=args.d,
            tokens=args.tokens,
            torch=torch.__version__,
            gpu=torch.cuda.get_device_name(device) if cuda else None,
            checksums=blocksum.implementation(),
            ckpt_dir=str(base_dir),
            fs=fstype(base_dir.resolve()),
            python=sys.version.split()[0],
        )
        _steps(w, BASELINE_STEPS)  # warm: kernels chosen, autocast's caches filled
        names = [n for n in WEIGHTS if n in args.rows.split(",")]
        budget = Budget(args.deadline, names)
        saved: dict[str, tuple[int, Any] | None] = {}
        savers: dict[str, Any] = {}
        for name in names:
            end = budget.end_of(name)
            if time.time() >= args.deadline:
                rec.write("skipped", name, reason="out of time before it started")
                continue
            try:
                if name in ("ftsup_async", "dcp_async"):
                    saver: Any = contenders.Ftsup(base_dir / "ftsup") if name == "ftsup_async" else None
                    if saver is None:
                        saver = contenders.DcpAsync(base_dir / "dcp", cuda)
                        rec.write("info", name, staging=saver.words)
                    savers[name] = saver
                    try:
                        saved[name] = save_row(w, rec, saver, end, args.repeats, nbytes)
                    finally:
                        saver.close()
                elif name == "torch_save":
                    saver = contenders.TorchSave(base_dir / "torch")
                    last = save_row(w, rec, saver, end, args.repeats, nbytes)
                    if last is not None:
                        contenders.remove(saver.path(last[0]))
                elif name == "raw_write":
                    raw_write_row(rec, base_dir / "raw", nbytes, end, args.repeats)
                else:
                    source = name.replace("_resume", "_async")
                    if saved.get(source) is None:
                        rec.write("skipped", name, reason=f"no checkpoint: {source} did not save")
                        continue
                    point = saved[source]
                    assert point is not None
                    resume_row(w, rec, savers[source], name, point, end, args.repeats, nbytes)
                    contenders.remove(savers[source].path(point[0]))
            except Exception as e:  # one row's failure is recorded; the next row still runs
                rec.write("error", name, reason=f"{type(e).__name__}: {e}"[:2000])
            _free_memory()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftsup.tools.bench.gpu.rows", description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, required=True, help="state size in GB (1e9 bytes)")
    p.add_argument("--label", required=True, help="the size's name in the table")
    p.add_argument("--dir", required=True, help="where the checkpoints go (removed as the rows go)")
    p.add_argument("--out", required=True, help="JSON lines appended here")
    p.add_argument("--deadline", type=float, default=time.time() + 3600, help="unix time: no repeat starts after")
    p.add_argument("--repeats", type=int, default=3, help="measured saves per row, after the first")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--d", type=int, default=2048, help="the blocks' width")
    p.add_argument("--tokens", type=int, default=4096, help="rows of a training step's batch")
    p.add_argument("--rows", default=",".join(WEIGHTS), help="which rows, comma-separated")
    p.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: torch's choice)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
