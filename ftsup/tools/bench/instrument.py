"""`ftsup bench instrument`: what the auto-instrumentation costs a training step of 25 ms on the reference model.

Rounds without and with the hook `ftsup run` installs, alternating in one process, sending to a real heartbeat
receiver (docs/benchmarks.md, "The auto-instrumentation's cost per step").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ftsup.tools.bench import shared


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The description and flags of `ftsup bench instrument`."""
    p.description = (
        "Train the reference trainer's model on CPU with each step padded to --step-ms, in rounds without and with "
        "the auto-instrumentation's hook (alternating, the order swapped each round), and report the steps' compute "
        "time both ways and the hook's own time per step (see ftsup/tools/bench/instrument.py)."
    )
    shared.add_output(p, work_dir=False)
    p.add_argument("--rounds", type=shared.positive, default=10, help="rounds of each kind, default 10")
    p.add_argument("--steps", type=shared.positive, default=40, help="steps in each round, default 40")
    p.add_argument("--step-ms", type=float, default=25.0, help="each step padded to this long, default 25")
    p.add_argument("--n-layer", type=shared.positive, default=2, help="the model's layers, default 2")
    p.add_argument("--n-embd", type=shared.positive, default=64, help="the model's width, default 64")


def run(args: argparse.Namespace) -> int:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from ftsup.protocol import RuntimeEnv
    from ftsup.trainer.auto.steps import STEPS, Progress
    from ftsup.trainer.examples.corpus import TokenWindows, generate
    from ftsup.trainer.examples.gpt import GPT
    from ftsup.trainer.runtime import RuntimeClient

    torch.set_num_threads(1)
    torch.manual_seed(0)
    seq_len, micro_batch = 64, 2  # the reference trainer's defaults
    model = GPT(256, seq_len, args.n_layer, 4, args.n_embd, 0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = TokenWindows(generate(1 << 16), seq_len)
    step_s = args.step_ms / 1000
    compute: dict[str, list[float]] = {"plain": [], "instrumented": []}
    hook_s: list[float] = []

    with tempfile.TemporaryDirectory(prefix="ftsup-bench-instrument-") as tmp:
        # The supervisor's side in a process of its own, as under `ftsup run`: reading beats costs this one nothing.
        receiver = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import receive; receive({tmp!r})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            if receiver.stdin is None or receiver.stdout is None or receiver.stdout.readline().strip() != "ready":
                raise RuntimeError("the heartbeat receiver did not start")
            client = RuntimeClient(RuntimeEnv(heartbeat_socket=str(Path(tmp) / "heartbeat.sock"), attempt=1))
            progress = Progress(lambda: client, taken=lambda: False)

            def timed_hook(opt: Any, a: Any, k: Any) -> None:
                t0 = time.perf_counter()
                STEPS.run(progress.stepped, opt)
                hook_s.append(time.perf_counter() - t0)

            position = 0
            for r in range(args.rounds):
                for kind in ("plain", "instrumented") if r % 2 == 0 else ("instrumented", "plain"):
                    handle = register_optimizer_step_post_hook(timed_hook) if kind == "instrumented" else None
                    for _ in range(args.steps):
                        start = time.perf_counter()
                        batch = torch.stack([data[(position + i) % len(data)][1] for i in range(micro_batch)])
                        position += micro_batch
                        optimizer.zero_grad(set_to_none=True)
                        model(batch[:, :-1], batch[:, 1:]).backward()
                        optimizer.step()
                        compute[kind].append(time.perf_counter() - start)
                        time.sleep(max(0.0, start + step_s - time.perf_counter()))
                    if handle is not None:
                        handle.remove()
            client.close()
            receiver.stdin.close()
            received = int(receiver.stdout.readline() or 0)
            receiver.wait(timeout=30)
        finally:
            if receiver.poll() is None:
                receiver.kill()
                receiver.wait()

    plain, instrumented, hook = map(shared.spread, (compute["plain"], compute["instrumented"], hook_s))
    rows = [
        {"name": "plain", "steps": len(compute["plain"]), **{f"compute_ms_{k}": v * 1e3 for k, v in plain.items()}},
        {
            "name": "instrumented",
            "steps": len(compute["instrumented"]),
            **{f"compute_ms_{k}": v * 1e3 for k, v in instrumented.items()},
        },
        {
            "name": "hook",
            "steps": len(hook_s),
            **{f"us_{k}": v * 1e6 for k, v in hook.items()},
            "pct_of_step": 100 * hook["median"] / step_s,
            "beats_sent": client.sent,
            "beats_received": received,
        },
    ]
    over = sum(t > step_s for ts in compute.values() for t in ts)
    result = {"step_ms": args.step_ms, "steps_over_budget": over, "results": rows}
    print(f"per-step cost of the auto-instrumentation, steps padded to {args.step_ms:g} ms ({over} ran over):")
    print(f"  {'':14}{'steps':>7}{'median':>12}{'p10':>12}{'p90':>12}")
    for row in rows[:2]:
        cells = "".join(f"{row[f'compute_ms_{k}']:>9.3f} ms" for k in ("median", "p10", "p90"))
        print(f"  {row['name'] + ' compute':14}{row['steps']:>7}{cells}")
    h = rows[2]
    cells = "".join(f"{h[f'us_{k}']:>9.1f} us" for k in ("median", "p10", "p90"))
    print(f"  {'hook':14}{h['steps']:>7}{cells}  = {h['pct_of_step']:.3f}% of a step")
    delta = (instrumented["median"] - plain["median"]) * 1e3
    print(f"  medians' difference: {delta:+.3f} ms; beats sent {h['beats_sent']}, received {h['beats_received']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def receive(directory: str) -> None:
    """The supervisor's side: a heartbeat receiver in `directory`, drained every 50 ms as the supervisor's loop reads
    it, until standard input closes; prints "ready" once listening, then the number of beats it read."""
    from ftsup.supervisor.run.heartbeat import HeartbeatReceiver

    with HeartbeatReceiver(Path(directory)) as receiver:
        print("ready", flush=True)
        closed = threading.Event()

        def wait_for_eof() -> None:
            sys.stdin.read()
            closed.set()

        threading.Thread(target=wait_for_eof, daemon=True).start()
        count = 0
        while not closed.wait(0.05):
            count += len(receiver.drain())
        print(count + len(receiver.drain()), flush=True)
