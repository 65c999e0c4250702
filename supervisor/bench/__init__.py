"""Benchmarks of the supervisor, behind `ftsup bench recovery` and `ftsup bench eviction`: tooling, not product.

- `recovery`: from a fault to the first resumed training step, ftsup against plain torchrun.
- `eviction`: steps lost per eviction, ftsup's emergency saves against periodic checkpoints only.

Both run the reference trainer under `ftsup run` as subprocesses and inject their faults with
`ftsup.supervisor.faults`; neither imports torch. The checkpoint engine's benchmark
(`ftsup bench checkpoint`, needs torch) is `ftsup.trainer.bench`.

The product (`ftsup run`, `ftsup status`, `ftsup ckpt`, `ftsup config` and everything they import)
never imports this package: `ftsup.supervisor.cli` imports a benchmark only when `ftsup bench`
asks for it (tests/unit/test_product_imports.py).
"""
