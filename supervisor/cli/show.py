"""`ftsup ckpt show DIR [--step N] [--json]`: what one checkpoint, a Hugging Face model directory or a DCP checkpoint
holds, read from manifests, headers and metadata only, never a tensor's byte (docs/cli.md, `ftsup ckpt show`).
Torch-free.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ftsup.store import dcpdir, dcpmeta, dtypes, hublayout, layout, pins, safefile
from ftsup.store.errors import NoCheckpointError
from ftsup.supervisor.cli import ckpt as cli_ckpt
from ftsup.supervisor.errors import UsageError

_TABLE_ROWS = 10_000  # beyond this the table stops (the JSON has every tensor)


def add_command(actions: Any, step_number: Callable[[str], int]) -> None:
    p = actions.add_parser(
        "show",
        help="one checkpoint (or Hugging Face model, or DCP directory): manifest, metadata, pin, tensors (headers)",
        description="Show the checkpoint of --step under DIR, or else the newest committed one: its manifest, the "
        "trainer's metadata (data_skips among them), its model config, its pin and its tensors (name, dtype, shape, "
        "bytes, files), read from its metadata and headers, never from tensor data. A DIR holding model.safetensors "
        "or model.safetensors.index.json (a Hugging Face model) is shown from its safetensors headers; one holding "
        ".metadata, or torchtitan's step-N/.metadata folders (a torch.distributed.checkpoint directory; --step picks "
        "the folder, default the newest), from its metadata, read without running its pickle.",
    )
    p.add_argument(
        "dir", metavar="DIR", type=Path, help="the checkpoint directory, a Hugging Face model or a DCP checkpoint"
    )
    p.add_argument("--step", type=step_number, help="the step to show (default: newest)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_show)


def cmd_show(args: argparse.Namespace) -> int:
    root = cli_ckpt.checkpoint_root(args.dir)
    committed = dict(layout.committed_dirs(root))
    if not committed and hublayout.is_hub_dir(root):
        if args.step is not None:
            raise UsageError(f"{root} is a Hugging Face model directory, not a checkpoint store: --step does not apply")
        return _show_hub(root, args.json)
    if not committed and dcpdir.is_dcp_dir(root):
        return _show_dcp(dcpdir.read(dcpdir.locate(root, args.step)), args.json)
    if args.step is None and not committed:
        raise NoCheckpointError(
            f"no committed checkpoint under {root} (nor a Hugging Face model: no "
            f"{hublayout.SINGLE_NAME} or {hublayout.INDEX_NAME})"
        )
    if args.step is not None and args.step not in committed:
        raise NoCheckpointError(cli_ckpt.no_step_message(root, args.step))
    return _show_checkpoint(root, committed[max(committed) if args.step is None else args.step], args.json)


def _show_checkpoint(root: Path, path: Path, as_json: bool) -> int:
    manifest, problems = layout.check_checkpoint(path)
    step = manifest.step if manifest else layout.parse_step_dirname(path.name)
    pinset = pins.read_pins(root)
    pin = next((p for p in pinset.pins if p.step == step), None)
    meta = dict(manifest.metadata) if manifest else {}
    consistent = manifest is not None and not problems
    trainer = meta.get("format") == hublayout.TRAINER_FORMAT
    tensors = None
    config: Any = meta.get("config")
    unread = "tensors: not read (the checkpoint fails the fast check)"
    if manifest is not None and consistent:
        unread = "tensors: none recorded (no dcp_metadata.json, nor safetensors weights)"
        if trainer and {hublayout.SINGLE_NAME, hublayout.INDEX_NAME} & set(manifest.files):
            tensors = _hub_rows(hublayout.read(path, follow_links=False))
        elif not trainer and layout.DCP_META_NAME in manifest.files:
            tensors = _engine_rows(dcpmeta.read(path, manifest))
        if trainer and hublayout.CONFIG_NAME in manifest.files:
            raw = layout.read_verified(path, manifest, hublayout.CONFIG_NAME, hublayout.CONFIG_MAX_BYTES)
            config = safefile.loads(raw, f"{path}/{hublayout.CONFIG_NAME}")  # checked against the manifest
    shown = {
        "path": str(path),
        "step": step,
        "consistent": consistent,
        "problems": [str(p) for p in problems],
        "kind": manifest.kind if manifest else None,
        "world_size": manifest.world_size if manifest else None,
        "created_unix": manifest.created_unix if manifest else None,
        "files": len(manifest.files) if manifest else None,
        "bytes": sum(e.size for e in manifest.files.values()) if manifest else None,
        "data_skips": meta.get("data_skips", []),
        "pinned": step in pinset.kept,
        "pin": pin.to_json() if pin else None,
        "metadata": meta,
        "format": None if manifest is None else "hf-trainer" if trainer else "ftsup",
        "config": config,
        "tensors": tensors,
        "tensor_bytes": None if tensors is None else sum(t["bytes"] for t in tensors),
    }
    if as_json:
        cli_ckpt.print_json(shown)
        return cli_ckpt.EXIT_OK
    for key in ("path", "step", "consistent", "kind", "world_size", "files", "bytes", "data_skips", "pinned"):
        value = shown[key]
        print(f"{key}: {cli_ckpt.human_bytes(value) if key == 'bytes' and isinstance(value, int) else value}")
    print(f"created: {cli_ckpt.utc(shown['created_unix'])} UTC")
    if pin is not None:
        print(f"pin: by {pin.who} at {cli_ckpt.utc(pin.pinned_unix)} UTC" + (f": {pin.reason}" if pin.reason else ""))
    for p in problems:
        print(f"problem: {p}")
    for key, value in meta.items():  # the trainer's metadata, as the manifest holds it (capped per line)
        print(f"metadata.{key}: {json.dumps(value)[:200]}")
    if trainer and config is not None:
        print(f"config: {json.dumps(config)[:200]}")
    _print_tensors(tensors, unread)
    return cli_ckpt.EXIT_OK


def _show_hub(root: Path, as_json: bool) -> int:
    model = hublayout.read(root)
    config = hublayout.read_config(root)
    tensors = _hub_rows(model)
    files: list[dict[str, Any]] = [
        {"file": f, "bytes": h.file_size, "tensors": len(h.tensors)} for f, h in model.headers.items()
    ]
    shown = {
        "path": str(root),
        "layout": "hub",
        "sharded": model.index is not None,
        "files": files,
        "bytes": sum(f["bytes"] for f in files),
        "index_metadata": model.index,
        "config": config,
        "tensors": tensors,
        "tensor_bytes": sum(t["bytes"] for t in tensors),
    }
    if as_json:
        cli_ckpt.print_json(shown)
        return cli_ckpt.EXIT_OK
    print(f"path: {root}")
    print(
        f"layout: Hugging Face, {'sharded (' + hublayout.INDEX_NAME + ')' if model.index is not None else 'one file'}"
    )
    for f in files:
        print(f"file: {f['file']} ({cli_ckpt.human_bytes(f['bytes'])}, {f['tensors']} tensors)")
    if model.index:
        print(f"index metadata: {json.dumps(model.index)[:200]}")
    print(f"config: {json.dumps(config)[:200]}" if config is not None else f"config: none ({hublayout.CONFIG_NAME})")
    _print_tensors(tensors, "")
    return cli_ckpt.EXIT_OK


def _show_dcp(ckpt: dcpdir.DcpCheckpoint, as_json: bool) -> int:
    files: dict[str, list[str]] = {}
    for t in ckpt.tensors.values():
        files[t.name] = sorted({c.file for c in t.chunks})
    tensors = [
        {"name": t.name, "dtype": t.dtype, "shape": list(t.size), "bytes": t.nbytes, "files": files[t.name]}
        for t in ckpt.tensors.values()
    ]
    name = ckpt.path.name
    shown: dict[str, Any] = {
        "path": str(ckpt.path),
        "layout": "dcp",
        "step": int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None,
        "version": ckpt.version,
        "files": [{"file": f, "bytes": n} for f, n in sorted(ckpt.files.items())],
        "bytes": sum(ckpt.files.values()),
        "tensors": tensors,
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "chunks": sum(len(t.chunks) for t in ckpt.tensors.values()),
        "values": [{"name": b.name, "bytes": b.length, "file": b.file} for b in ckpt.blobs.values()],
    }
    if as_json:
        cli_ckpt.print_json(shown)
        return cli_ckpt.EXIT_OK
    print(f"path: {ckpt.path}")
    print(f"layout: torch.distributed.checkpoint (metadata version {ckpt.version})")
    if shown["step"] is not None:
        print(f"step: {shown['step']}")
    for f in shown["files"]:
        print(f"file: {f['file']} ({cli_ckpt.human_bytes(f['bytes'])})")
    print(f"values saved as bytes (not tensors): {len(ckpt.blobs)}")
    _print_tensors(tensors, "")
    return cli_ckpt.EXIT_OK


def _engine_rows(meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per tensor of `dcp_metadata.json` (already checked), in the state dict's order."""
    files: dict[str, list[str]] = {}
    for s in meta["storage"]:
        held = files.setdefault(s["fqn"], [])
        if s["file"] not in held:
            held.append(s["file"])
    rows = []
    for fqn in dcpmeta.state_order(meta):
        t = meta["tensors"][fqn]
        n = dtypes.lookup(t["dtype"], fqn).itemsize
        for d in t["size"]:
            n *= d
        rows.append(
            {
                "name": fqn,
                "dtype": t["dtype"],
                "shape": list(t["size"]),
                "bytes": n,
                "files": sorted(files.get(fqn, [])),
            }
        )
    return rows


def _hub_rows(model: hublayout.HubModel) -> list[dict[str, Any]]:
    return [
        {"name": name, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.nbytes, "files": [model.weight_map[name]]}
        for name, e in model.tensors.items()
    ]


def _print_tensors(tensors: Sequence[Mapping[str, Any]] | None, unread: str) -> None:
    if tensors is None:
        print(unread)
        return
    total = sum(t["bytes"] for t in tensors)
    print(f"tensors: {len(tensors)}, {cli_ckpt.human_bytes(total)}")
    rows = [("NAME", "DTYPE", "SHAPE", "BYTES", "FILES")]
    rows += [
        (t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()", str(t["bytes"]), ",".join(t["files"]))
        for t in tensors[:_TABLE_ROWS]
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    for row in rows:
        print("  " + "  ".join([*(row[c].ljust(w) for c, w in enumerate(widths)), row[-1]]))
    if len(tensors) > _TABLE_ROWS:
        print(f"  ... and {len(tensors) - _TABLE_ROWS} more (--json lists them all)")
