"""Fault injection from outside a running job, and what is built on it: `ftsup demo` (`demo`), `ftsup chaos`
(`chaosrun`) and the benchmarks' jobs (`refjob`, `chaos`). Tooling, never imported by the product; nothing here
imports torch (docs/chaos.md).
"""
