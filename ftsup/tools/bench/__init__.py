"""Benchmarks of the supervisor, behind `ftsup bench recovery|eviction|anomaly`: tooling, not product.

- `recovery`: from a fault to the first resumed training step, ftsup against plain torchrun.
- `eviction`: steps lost per eviction, ftsup's emergency saves against periodic checkpoints only.
- `anomaly`: nan and spike faults caught and rolled back past, against a crash's recovery; false positives.

All run the reference trainer under `ftsup run` as subprocesses, with faults from
`ftsup.tools.faults` or the trainer's own; none imports torch. The checkpoint engine's benchmark
(`ftsup bench checkpoint`, needs torch) is `ftsup.tools.bench.checkpoint`.

The product (`ftsup run`, `ftsup status`, `ftsup ckpt`, `ftsup config` and everything they import)
never imports this package: `ftsup.supervisor.cli` imports a benchmark only when `ftsup bench`
asks for it (tests/unit/test_product_imports.py).
"""
