"""The checkpoint engine's benchmark, `ftsup bench checkpoint` (the supervisor's are `ftsup.tools.bench`).

The CLI calls `add_checkpoint_arguments(parser)` and `run_checkpoint(args)`. Importing this
package does not import torch: the parent process only plans, launches rank processes
(`ftsup.tools.bench.checkpoint.rank`) and reports.

Modules: `checkpoint` (orchestration, options), `launch` (rank groups, timeouts, reaping),
`report` (pure: records -> rows, ratios, table), `hf_report` (the same for the Hugging Face rows),
`shape` (model size), and inside the rank processes `rank`, `synthetic`, `probes`, `peer_rows`,
`ftsup_rows`, `loads`, `hf_rows` (and the export's own process, `hf_child`).

`ftsup bench scale` (`add_scale_arguments`, `run_scale`) is `scale` (orchestration), `scale_report` (pure), and
in its child processes `scale_child`, `scale_state`, `scale_ops` (with `ftsup.tools.bench.scale.store`).

Tooling, not product: the product (`ftsup run`, `status`, `config`, `ckpt` and the trainer library)
never imports it; `ftsup.supervisor.cli` does only for `ftsup bench checkpoint` and `ftsup bench scale`.
"""
