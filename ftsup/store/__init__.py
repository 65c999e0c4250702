"""The checkpoint store: the on-disk format both sides of ftsup read, stdlib only.

The supervisor reads the store (to list, verify and choose the resume point; `ftsup ckpt`) more
than the trainer does, and the checkpoint engine (`ftsup.trainer.checkpoint`, which needs torch)
writes it. Both import this package; it imports neither of them, nor torch:

- `layout`: names (`step-N`, `.partial`, `.corrupt`), the manifest, fast and deep verification, quarantine;
- `safefile`: every file read from a store, as hostile input;
- `checksums`, `blocksum` (with the C extension `_blocksum`): recorded checksums and block checksums;
- `choice`: which checkpoint to resume from;
- `retention`: which checkpoints to keep, and deleting the rest;
- `pins`: checkpoints an operator pinned against retention, and the journal of who did and why;
- `dcpmeta`: the schema of `dcp_metadata.json`;
- `durable` (with `durable_fs`, and `s3`, `s3upload`, `s3list`: boto3): the durable tier, checkpoints copied to
  object storage or a shared filesystem;
- `dtypes`: the dtypes by name (a checkpoint's, safetensors');
- `stheader`, `hublayout`: safetensors headers and the Hugging Face Hub's layout of a model, read as hostile input;
- `errors`: the `CheckpointError` tree.

The format, the commit protocol and the rules for a hostile store: `DESIGN.md` beside this file.
Not here: writing tensors, staging, loading (the engine's).
"""
