"""Tooling, never imported by the product: benchmarks (`bench`) and fault injection with the demo (`faults`)."""
