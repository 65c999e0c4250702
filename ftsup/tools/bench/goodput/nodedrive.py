"""One contender's run of `ftsup bench node-loss`: both nodes started, each scheduled loss delivered while both train
(node B's every process SIGKILLed, its disk, state and memory directories wiped, a replacement with empty ones
started `replace_s` later), the loss log timed as it grows. Whatever happens, every process of the job is SIGKILLed
and reaped before `drive` returns.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ftsup.tools.bench.goodput.nodeloss import Loss, StepLine
from ftsup.tools.bench.goodput.twonode import Node, NodeContender, TwoNodeJob
from ftsup.tools.faults import chaos
from ftsup.tools.faults.refjob import start_guarded

SETTLE_STEPS = 5  # steps both nodes log together after a (re)join before the next loss is delivered
POLL_S = 0.05


@dataclass
class NodeRun:
    t0: float
    end: float
    lines: list[StepLine]
    losses: list[Loss]
    completed: bool
    exit_codes: dict[str, int | None]
    launches: dict[str, int]
    ended_by: str | None
    orphans: list[str] = field(default_factory=list)
    output: str = ""  # every launcher's output, node A's first (the ranks' `checkpoint_loaded` lines among it)


class _Nodes:
    """The two nodes' launchers: started, lost, replaced, and at the end every process of theirs killed."""

    def __init__(self, contender: NodeContender, job: TwoNodeJob, env: dict[str, str]) -> None:
        self.contender, self.job, self.env = contender, job, env
        self.a, self.b = job.nodes()
        self.procs: dict[str, subprocess.Popen[bytes] | None] = {"a": None, "b": None}
        self.launches = {"a": 0, "b": 0}
        self.codes: dict[str, int | None] = {"a": None, "b": None}

    def start(self, node: Node) -> None:
        self.launches[node.key] += 1
        out = self.job.base.root / f"{node.node_id}-{self.launches[node.key]}.out"
        argv = self.contender.argv(self.job, node)
        self.procs[node.key] = start_guarded(argv, env=self.contender.env(node, self.env), cwd=node.root, out_path=out)

    def exited(self) -> str | None:
        """A node whose launcher has exited, with its status, or None."""
        for key, p in self.procs.items():
            if p is not None and p.poll() is not None:
                self.codes[key] = p.returncode
                return f"node {key}'s launcher exited {p.returncode}"
        return None

    def lose_b(self) -> float:
        """Node B lost whole: every process of it SIGKILLed at once, its directories wiped. When it was lost."""
        t = time.time()
        chaos.stop_all(chaos.matching_processes([self.b.marker()]))
        p, self.procs["b"] = self.procs["b"], None
        if p is not None:
            p.kill()
            p.wait(timeout=30)
        shutil.rmtree(self.b.home, ignore_errors=True)
        shutil.rmtree(self.job.memory(self.b), ignore_errors=True)
        return t

    def wait_all(self, deadline: float, done: Callable[[], bool]) -> None:
        """Both launchers' exits; a replacement still running once the other node has finished the job (`done()`:
        its last step logged) is stopped, not counted: it joined a job that was over, and alone it would start
        the job again from its empty directories."""
        while time.time() < deadline:
            for key, p in self.procs.items():
                if p is not None and self.codes[key] is None and p.poll() is not None:
                    self.codes[key] = p.returncode
            running = [k for k, p in self.procs.items() if p is not None and self.codes[k] is None]
            if not running:
                return
            if running == ["b"] and self.codes["a"] == 0 and done():
                chaos.stop_all(chaos.matching_processes([self.b.marker()]))
                p, self.procs["b"] = self.procs["b"], None
                if p is not None:
                    p.kill()
                    p.wait(timeout=30)
                return
            time.sleep(POLL_S)
        raise chaos.ChaosError("a node's launcher did not exit before the run's timeout")

    def close(self) -> list[str]:
        """SIGKILL whatever of either node is left and reap it; what was left, described."""
        left = chaos.matching_processes([self.a.marker(), self.b.marker()])
        described = [chaos.describe(p) for p in left]
        chaos.stop_all(left)
        for p in self.procs.values():
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.wait(timeout=30)
        return described


def drive(
    contender: NodeContender,
    job: TwoNodeJob,
    times: Sequence[float],
    *,
    replace_s: float,
    timeout_s: float,
    env: dict[str, str],
) -> NodeRun:
    """Run the job, losing node B at each of `times` (seconds after both nodes first trained together) once both
    have trained SETTLE_STEPS steps together since the last (re)join."""
    nodes = _Nodes(contender, job, env)
    job.base.root.mkdir(parents=True, exist_ok=True)
    losses: list[Loss] = []
    ended_by: str | None = None
    t0 = time.time()
    deadline = t0 + timeout_s
    tail = chaos.LossLogTail(job.base.loss_log, interval_s=POLL_S)
    orphans: list[str] = []
    try:
        with tail:
            nodes.start(nodes.a)
            nodes.start(nodes.b)
            joined = t0
            for at in times:
                if not _ready(nodes, tail, at, joined, job.base.steps, deadline):
                    break
                seen = tail.lines()
                before = seen[-1].step if seen else 0  # where training was, not the most it ever reached
                t = nodes.lose_b()
                losses.append(Loss(t, before, None))
                finished = False
                while time.time() < min(deadline, t + replace_s) and not finished:
                    if (why := nodes.exited()) is not None:
                        if nodes.codes["a"] != 0:
                            raise chaos.ChaosError(f"{why} while node b was down")
                        finished = True  # the survivor finished the job alone: nothing left to join
                    time.sleep(POLL_S)  # the replacement's boot, not a wait for an event
                if finished:
                    break
                joined = time.time()
                nodes.start(nodes.b)
                losses[-1] = Loss(t, before, joined)
            nodes.wait_all(deadline, lambda: job.base.steps in {ln.step for ln in tail.lines()})
    except chaos.ChaosError as e:
        ended_by = str(e)
    finally:
        end = time.time()
        orphans = nodes.close()
    lines = [StepLine(ln.t, ln.step, int(ln.record.get("world_size") or 0)) for ln in tail.lines()]
    steps = {ln.step for ln in lines}
    # a node lost last and not replaced (the survivor finished alone) has no exit status to count
    completed = ended_by is None and all(nodes.codes[k] == 0 for k, p in nodes.procs.items() if p is not None)
    completed = completed and steps >= set(range(1, job.base.steps + 1))
    if ended_by is None and not completed:
        ended_by = f"exit statuses {nodes.codes}, {len(steps)} of {job.base.steps} steps logged"
    return NodeRun(
        t0=t0,
        end=end,
        lines=lines,
        losses=losses,
        completed=completed,
        exit_codes=nodes.codes,
        launches=nodes.launches,
        ended_by=ended_by,
        orphans=orphans if ended_by is None else [],  # after an error, what was left is this cleanup's to kill
        output=_outputs(job),
    )


def _ready(nodes: _Nodes, tail: chaos.LossLogTail, at: float, joined: float, steps: int, deadline: float) -> bool:
    """Wait until a loss is due (`at` seconds after both nodes first trained together) and both nodes trained
    SETTLE_STEPS steps together since `joined`: True; False when the job has logged its last step first (no more
    losses to deliver). A launcher that exits is a ChaosError."""

    def check() -> str | None:
        lines = tail.lines()
        if steps in {ln.step for ln in lines}:
            return "done"
        if (why := nodes.exited()) is not None:
            raise chaos.ChaosError(f"{why} before the job finished")
        both = [ln for ln in lines if ln.record.get("world_size") == 2]
        due = both[0].t + at if both else None
        together = sum(1 for ln in both if ln.t > joined)
        return "go" if due is not None and time.time() >= due and together >= SETTLE_STEPS else None

    return chaos.poll_until(check, max(0.0, deadline - time.time()), "a node loss's turn", interval_s=POLL_S) == "go"


def _outputs(job: TwoNodeJob) -> str:
    texts = []
    for node in job.nodes():
        for path in sorted(job.base.root.glob(f"{node.node_id}-*.out"), key=lambda p: p.stat().st_mtime):
            try:
                texts.append(path.read_text(errors="replace"))
            except OSError:
                continue
    return "\n".join(texts)
