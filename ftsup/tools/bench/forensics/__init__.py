"""`ftsup bench forensics`: how long the evidence of a hang takes to capture for a node of ranks (docs/benchmarks.md,
"The evidence of a hang")."""
