"""Benchmarks behind `ftsup bench`: tooling, never imported by the product (docs/benchmarks.md).

`recovery`, `eviction`, `anomaly` and `goodput` run the reference trainer under `ftsup run` and never import torch;
`checkpoint` measures the checkpoint engine in rank processes of its own, `scale` the engine and store by simulation.
"""
