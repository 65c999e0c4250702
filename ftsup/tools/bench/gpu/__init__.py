"""The GPU check's benchmark rows (`tests/gpu/run.sh`, docs/gpu.md): ftsup's save from CUDA memory against DCP's
`async_save` with pinned-memory staging and `torch.save`, with the raw disk write and the resumes. Tooling: the
product never imports it."""
