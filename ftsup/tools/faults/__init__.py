"""Fault injection from outside a running job, and the demo built on it: tooling, not product.

- `chaos`: faults sent as an operator or a chaos tool would (signals to ranks, to the supervisor)
  and what can be observed from outside (rank processes, loss log, supervisor log, leftovers).
- `refjob`: the reference trainer as a supervised job, started, stopped and read from outside.
- `demo`: `ftsup demo`, the reference trainer under `ftsup run` with faults injected, its loss
  log compared bitwise with an uninterrupted run's.
- `ftsup chaos` (`chaosrun`): a seeded plan of every kind of fault (`plan`), thrown at the
  reference trainer (`inject`; a full disk on a tmpfs, `diskfull`; node loss with two supervisors,
  `nodes`) or at a job of one's own (`configjob`), and the invariants checked (`invariants`);
  evictions come from `metadata_server`, a local cloud metadata server (the tests' too).

Shared by the demo and the benchmarks (`ftsup.tools.bench`). Nothing here imports torch.
The product (`ftsup run`, `ftsup status`, `ftsup ckpt`, `ftsup config` and everything they import)
never imports this package: `ftsup.supervisor.cli` imports it only for `ftsup demo`, `ftsup chaos`
and `ftsup bench` (tests/unit/test_product_imports.py).
"""
