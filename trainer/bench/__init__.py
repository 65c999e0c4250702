"""The checkpoint engine's benchmark, `ftsup bench checkpoint` (the supervisor's are `ftsup.supervisor.bench`).

The CLI calls `add_checkpoint_arguments(parser)` and `run_checkpoint(args)`. Importing this
package does not import torch: the parent process only plans, launches rank processes
(`ftsup.trainer.bench.rank`) and reports.

Modules: `checkpoint` (orchestration, options), `launch` (rank groups, timeouts, reaping),
`report` (pure: records -> rows, ratios, table), `hf_report` (the same for the Hugging Face rows),
`shape` (model size), and inside the rank processes `rank`, `synthetic`, `probes`, `peer_rows`,
`ftsup_rows`, `loads`, `hf_rows` (and the export's own process, `hf_child`).

`ftsup bench scale` (`add_scale_arguments`, `run_scale`) is `scale` (orchestration), `scale_report` (pure), and
in its child processes `scale_child`, `scale_state`, `scale_ops` (with `ftsup.supervisor.bench.scale_store`).

Tooling, not product: the product (`ftsup run`, `status`, `config`, `ckpt` and the trainer library)
never imports it; `ftsup.supervisor.cli` does only for `ftsup bench checkpoint` and `ftsup bench scale`.
"""

from __future__ import annotations

from ftsup.trainer.bench.checkpoint import add_checkpoint_arguments, run_checkpoint
from ftsup.trainer.bench.scale import add_scale_arguments, run_scale

__all__ = ["add_checkpoint_arguments", "add_scale_arguments", "run_checkpoint", "run_scale"]
