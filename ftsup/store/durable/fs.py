"""The durable tier on a shared filesystem: a checkpoint store of the local layout, written by copying and
committed by a rename (ftsup/store/DESIGN.md, Durable tier).
"""

from __future__ import annotations

import errno
import math
import os
import re
import secrets
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ftsup.store import checksums, layout, retention, safefile
from ftsup.store.durable import tier as durable
from ftsup.store.durable.backend import Backend
from ftsup.store.errors import (
    CheckpointCorruptError,
    CheckpointError,
    DurableConflictError,
    DurableTierError,
    ManifestError,
    NoCheckpointError,
)

_UPLOAD = re.compile(r"^\.step-\d{9,18}\.upload-data-[0-9a-f]{24}$")
_LEFTOVER = re.compile(r"^\..+\.tmp-[0-9a-f]{8}$")


class FilesystemTier(Backend):
    """A durable tier in the directory `location.path` (see the module docstring)."""

    def __init__(self, location: durable.Location, options: durable.DurableOptions) -> None:
        if location.path is None:
            raise ValueError("not a filesystem location")
        super().__init__(location, options)
        self.root = location.path

    def step_url(self, step: int) -> str:
        return str(self.root / layout.step_dirname(step))

    # ------------------------------------------------------------------ upload

    def upload(
        self,
        ckpt_dir: str | os.PathLike[str],
        *,
        on_part: durable.PartHook | None = None,
        node: str | None = None,
        pause: durable.PauseHook | None = None,
    ) -> durable.UploadReport:
        local = durable.read_local(ckpt_dir)
        if node is not None and local.manifest.nodes is not None and len(local.manifest.nodes) > 1:
            raise CheckpointError(
                f"{local.path}: a node's part of a checkpoint goes to a durable tier on object storage (s3://) only; "
                "a shared filesystem can be the checkpoint store itself (checkpoint.dir_shared: true)"
            )
        step = local.manifest.step
        total = sum(e.size for e in local.manifest.files.values())
        already = durable.UploadReport(step, self.step_url(step), "already", len(local.manifest.files), total)
        final = self.root / layout.step_dirname(step)
        if os.path.lexists(final):
            return self._same_or_conflict(step, local.manifest_raw, already)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            work = self.root / f".{layout.step_dirname(step)}.upload-{local.token}"
            try:
                os.mkdir(work, 0o755)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(work).st_mode):
                    raise DurableTierError(f"{work}: is not a directory; an upload cannot use it") from None
            with ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="ftsup-durable") as pool:
                files = sorted(local.manifest.files.items())
                sent = list(pool.map(lambda item: self._copy(local, item[0], item[1], work, on_part, pause), files))
            _remove_leftovers(work)
            manifest_tmp = work / f".{layout.MANIFEST_NAME}.tmp-{secrets.token_hex(4)}"
            layout.write_file_durable(manifest_tmp, local.manifest_raw)
            os.replace(manifest_tmp, work / layout.MANIFEST_NAME)
            _fsync_tree(work)
        except OSError as e:
            raise DurableTierError(f"{self.root}: cannot upload step {step} ({e.strerror or e})") from e
        try:
            os.rename(work, final)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                return self._same_or_conflict(step, local.manifest_raw, already)
            raise DurableTierError(f"{final}: cannot commit ({e.strerror or e})") from e
        layout.fsync_dir(self.root)
        kept = sum(1 for _, was_there in sent if was_there)
        return durable.UploadReport(
            step,
            self.step_url(step),
            "committed",
            len(sent),
            total,
            bytes_sent=sum(n for n, _ in sent),
            parts_sent=len(sent) - kept,
            parts_kept=kept,
        )

    def _same_or_conflict(self, step: int, ours: bytes, already: durable.UploadReport) -> durable.UploadReport:
        try:
            _, theirs = self.manifest(step)
        except CheckpointError as e:
            raise DurableConflictError(f"{self.step_url(step)}: is there and is not this checkpoint ({e})") from None
        if theirs != ours:
            raise DurableConflictError(
                f"{self.step_url(step)}: already committed with other content (another writer's checkpoint of step "
                f"{step}); a committed step is never overwritten"
            )
        return already

    def _copy(
        self,
        local: durable.LocalCheckpoint,
        rel: str,
        entry: layout.FileEntry,
        work: Path,
        on_part: durable.PartHook | None,
        pause: durable.PauseHook | None = None,
    ) -> tuple[int, bool]:
        """Copy one file into the upload folder, checked as it is read; (bytes written, whether it was there)."""
        algorithm = local.manifest.checksum_algorithm
        dest = work / rel
        try:
            if checksums.file_checksum(dest, algorithm) == entry.checksum and os.lstat(dest).st_size == entry.size:
                return 0, True
        except (CheckpointError, OSError):
            pass  # missing, or not what it should be: written again
        safefile.resolve_inside(work, rel)  # a link planted on the way out of the upload folder is refused,
        dest.parent.mkdir(parents=True, exist_ok=True)
        safefile.resolve_inside(work, rel)  # before and after the folders on the way are made
        tmp = dest.with_name(f".{dest.name}.tmp-{secrets.token_hex(4)}")
        src = safefile.open_regular(safefile.resolve_inside(local.path, rel), f"{local.path}/{rel}")
        crcs: list[int] = []
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                self._write_copy(src, out, local, rel, entry, crcs, on_part, pause)
            except BaseException:
                os.close(out)
                os.unlink(tmp)  # ours (O_EXCL): a copy cut short leaves nothing in the upload folder
                raise
            os.close(out)
        finally:
            os.close(src)
        why = durable.blocks_problem(entry, crcs, algorithm)
        if why is not None:
            os.unlink(tmp)
            raise CheckpointCorruptError(f"{local.path}/{rel}: {why}", path=str(local.path), file=rel)
        os.replace(tmp, dest)
        return entry.size, False

    def _write_copy(
        self,
        src: int,
        out: int,
        local: durable.LocalCheckpoint,
        rel: str,
        entry: layout.FileEntry,
        crcs: list[int],
        on_part: durable.PartHook | None,
        pause: durable.PauseHook | None = None,
    ) -> None:
        """Copy `src` to `out` in chunks, appending each chunk's block checksums to `crcs`; fsync `out`. `pause` is
        called before each chunk is read."""
        for number, (offset, length) in enumerate(durable.part_plan(entry.size, durable.READ_CHUNK_BYTES), 1):
            if pause is not None:
                pause(math.inf)
            data = safefile.pread_full(src, length, offset)
            if len(data) != length:
                raise CheckpointCorruptError(f"{local.path}/{rel}: shorter than its manifest records", file=rel)
            checksums.block_crcs(data, crcs, local.manifest.checksum_algorithm)
            view = memoryview(data)
            while view:
                view = view[os.write(out, view) :]
            if on_part is not None:
                on_part(rel, number)
        os.fsync(out)

    # ------------------------------------------------------------------ reads

    def manifest(self, step: int) -> tuple[layout.Manifest, bytes]:
        ckpt = self.root / layout.step_dirname(step)
        if not os.path.lexists(ckpt / layout.MANIFEST_NAME):
            raise NoCheckpointError(f"{ckpt}: no manifest (not committed in the durable tier)")
        where = str(ckpt / layout.MANIFEST_NAME)
        raw = safefile.read_regular(ckpt / layout.MANIFEST_NAME, where, layout.MANIFEST_MAX_BYTES, error=ManifestError)
        manifest = layout.parse_manifest(raw, where)
        if manifest.step != step:
            raise ManifestError(f"{where}: records step {manifest.step} but lives in {ckpt.name}")
        return manifest, raw

    def read_into(
        self, step: int, token: str, rel: str, offset: int, length: int, piece: int, each: durable.PieceHook
    ) -> None:
        """Read from the regular file `rel` of the step's folder (`token` names the data of an object store only)."""
        ckpt = self.root / layout.step_dirname(step)
        path = safefile.resolve_inside(ckpt, rel)
        fd = safefile.open_regular(path, str(path))
        try:
            done = 0
            while True:
                self.check_deadline(str(path))  # a mount that reads slowly ends by the operation's deadline too
                want = min(piece, length - done)
                data = safefile.pread_full(fd, want, offset + done)  # whole pieces: block-aligned checksums
                if len(data) != want:
                    raise layout.CheckpointCorruptError(
                        f"{path}: {done + len(data)} bytes at {offset}, asked for {length}", file=rel
                    )
                each(offset + done, data)
                done += want
                if done >= length:
                    return
        finally:
            os.close(fd)

    def list_checkpoints(self, *, deep: bool = False) -> durable.DurableListing:
        found = layout.list_checkpoints(self.root, deep=deep)
        steps = {Path(c.path).name for c in found}
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            names = []
        others = [
            durable.clean_name(n) + (" (an upload not committed)" if _UPLOAD.match(n) else "")
            for n in names
            if n not in steps
        ]
        return durable.DurableListing(found, others)

    def committed_steps(self) -> list[int]:
        return [step for step, _ in layout.committed_dirs(self.root)]

    def inspect(self, step: int, *, deep: bool = False) -> layout.CheckpointInfo:
        ckpt = self.root / layout.step_dirname(step)
        if not os.path.lexists(ckpt) or not stat.S_ISDIR(os.lstat(ckpt).st_mode):
            raise NoCheckpointError(f"{ckpt}: no committed checkpoint of step {step} in the durable tier")
        return layout.inspect_checkpoint(ckpt, deep=deep)

    def delete(self, step: int) -> int:
        name = layout.step_dirname(step)
        manifest, _ = self.manifest(step)
        doomed = f".{name}.deleting-{os.getpid()}"
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.rename(name, doomed, src_dir_fd=fd, dst_dir_fd=fd)  # the checkpoint stops existing here
            os.fsync(fd)
            retention.remove_dir(fd, doomed)
            os.fsync(fd)
        finally:
            os.close(fd)
        return len(manifest.files) + 1


def _remove_leftovers(top: Path) -> None:
    """Remove the temporary copies an upload killed midway left in its folder (plain files of the names `_copy`
    gives them), so that none of them is committed with the checkpoint."""
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            path = Path(dirpath) / name
            if _LEFTOVER.match(name) and stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)


def _fsync_tree(top: Path) -> None:
    """fsync every directory under `top` (the files were fsynced as written), deepest first."""
    for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):
        layout.fsync_dir(dirpath)
