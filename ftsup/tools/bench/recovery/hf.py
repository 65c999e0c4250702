"""Kill -> first resumed step, the HF Trainer example against the reference trainer, run by hand:
`python -m ftsup.tools.bench.recovery.hf [--repeats 3] [--dir DIR] [--json FILE]`. Each trainer runs short jobs
under `ftsup run`, one of each per round, each with rank 1 SIGKILLed once; the target: HF at most 1.5 x the
reference (docs/benchmarks.md, "Recovery from a fault"). Never imports torch itself.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ftsup.tools.bench.recovery.common import aim, rounded, row, wait_aimed
from ftsup.tools.faults import chaos
from ftsup.tools.faults.refjob import (
    TrainerJob,
    child_env,
    fault_timeline,
    new_run_id,
    start_supervisor,
    stop_supervisor,
    wait_exit,
    wait_resumed,
)

IMPORTS = {
    "python": "pass",
    "torch": "import torch",
    "gpt": "import ftsup.trainer.examples.gpt",
    "hf": "import ftsup.trainer.examples.hf_gpt2, ftsup.trainer.hf.callback\n"
    "from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments",
}


def write_hf_config(job: TrainerJob) -> None:
    command = [sys.executable, "-m", "ftsup.trainer.examples.hf_gpt2", "--steps", str(job.steps)]
    command += ["--save-every", str(job.ckpt_every), "--eval-every", str(10 * job.steps)]
    command += ["--min-step-s", str(job.min_step_s), "--loss-log", str(job.loss_log)]
    sections = {"job": {"env": {"PYTHONPATH": child_env()["PYTHONPATH"], "OMP_NUM_THREADS": "1"}}}
    replace(job, command=tuple(command), sections={**sections, "restart": {"max_restarts": 20}}).write_config()


def measure_one(name: str, root: Path, min_step_s: float) -> dict[str, Any]:
    """One job of `name` under `ftsup run`, one SIGKILL of rank 1 three steps past a checkpoint; its
    `fault_timeline` once the job has finished."""
    step = aim(10, 5)
    job = TrainerJob(root, new_run_id(f"hf-bench-{name}"), step + 4, min_step_s=min_step_s)
    write_hf_config(job) if name == "hf" else job.write_config()
    proc = start_supervisor(job, "1")
    try:
        with chaos.LossLogTail(job.loss_log) as tail:
            wait_aimed(job, tail, step, 300, proc)
            ranks = chaos.wait_for_ranks(lambda: chaos.supervised_ranks(job.state_dir), job.nproc, 60)
            t = chaos.send(ranks[1], signal.SIGKILL)
            line = wait_resumed(job, tail, t, 180)
            print(f"  {name}: first resumed step {line.step} {line.t - t:.2f} s after the kill", flush=True)
            code = wait_exit(proc, 600, f"the {name} job")
            timeline = fault_timeline(job, tail, t)
    finally:
        stop_supervisor(proc, job)
    return {**timeline, "exit_code": code}


def import_times(runs: int = 3) -> dict[str, float | None]:
    """Seconds a new interpreter takes to import what each trainer imports (median of `runs`)."""
    out: dict[str, float | None] = {}
    for name, code in IMPORTS.items():
        times = []
        for _ in range(runs):
            t = time.monotonic()
            subprocess.run([sys.executable, "-c", code], env=child_env(), check=True, timeout=120)
            times.append(time.monotonic() - t)
        out[name] = rounded(chaos.median(times))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ftsup.tools.bench.recovery.hf", description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-step-s", type=float, default=0.1)
    p.add_argument("--dir", type=Path, help="where the jobs run (default: a new temporary directory)")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="ftsup-hf-bench-"))
    measured: dict[str, list[dict[str, Any]]] = {"gpt": [], "hf": []}
    for i in range(args.repeats):  # side by side: one job of each per round, the first alternating
        for name in ("gpt", "hf") if i % 2 == 0 else ("hf", "gpt"):
            measured[name].append(measure_one(name, root / f"{name}-{i}", args.min_step_s))
    rows = [{**row(name, "kill", m), "samples": [f.get("recover_s") for f in m]} for name, m in measured.items()]
    startup = import_times()
    gpt, hf = rows
    ratio = rounded(hf["recover_s"] / gpt["recover_s"]) if gpt["recover_s"] and hf["recover_s"] else None
    result = {
        "results": rows,
        "startup_s": startup,
        "ratio": ratio,
        "target_ratio": 1.5,
        "pass": ratio is not None and ratio <= 1.5,
    }
    for r in rows:
        print(f"{r['name']:>4}: kill -> first resumed step {r['recover_s']} s (median), split {r.get('split')}")
    print(f"imports in a new interpreter: {startup}")
    print(f"ratio hf / gpt: {ratio} (target <= 1.5)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
