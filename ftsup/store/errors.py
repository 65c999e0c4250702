"""The exception tree of the checkpoint store and engine (torch-free); callers catch `CheckpointError`."""

from __future__ import annotations

import errno
import os


class CheckpointError(Exception):
    """Base of every error raised by `ftsup.store` and `ftsup.trainer.checkpoint`."""


class ManifestError(CheckpointError):
    """A manifest is missing, unreadable, or describes something unsafe or impossible."""


class CheckpointFormatError(ManifestError):
    """A checkpoint in a format this ftsup does not read (a newer `format_version`, checksum
    algorithm or block size): it is never used, and never renamed or deleted either, since the
    newer ftsup that wrote it may be running next to this one."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint's files do not match its manifest (size or checksum)."""

    def __init__(self, message: str, *, path: str | None = None, file: str | None = None):
        super().__init__(message)
        self.path = path
        self.file = file


class NoCheckpointError(CheckpointError):
    """No consistent checkpoint exists where one was asked for.

    `rejected`: the checkpoints that were there but could not be used (one line each: the
    directory, what was done with it, why), so that a fresh start after them is never silent."""

    def __init__(self, message: str, *, rejected: list[str] | None = None):
        super().__init__(message)
        self.rejected = rejected or []


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the state it is loaded into (names, shapes, dtypes)."""

    def __init__(self, message: str, *, keys: list[str] | None = None):
        super().__init__(message)
        self.keys = keys or []


class CheckpointSaveError(CheckpointError):
    """A save failed; the previous committed checkpoint is untouched."""


class DurableTierError(CheckpointError):
    """The durable tier could not be reached or refused a request (the store down, a connection cut, credentials
    refused, a bucket missing): nothing was committed by the call that raised it, and the same call made again
    resumes where it stopped."""


class DurableWaitError(DurableTierError):
    """This writer's part of a checkpoint is in the durable tier, and its commit waits for the parts of other
    writers (the other nodes of a job whose nodes keep separate fast tiers): the same call made later commits it,
    or finds it committed."""


class DurableConflictError(CheckpointError):
    """The durable tier already holds a different checkpoint of this step (another writer committed it first):
    a committed step is never overwritten."""


class ModelFileError(CheckpointError):
    """A model's files outside the store (a Hugging Face model directory: its safetensors files, their
    index, its config) are missing or malformed; the message names the file and the tensor."""


_OS_WORDS = {
    errno.EISDIR: "is a directory, not a file",
    errno.ENOTDIR: "a part of its path is a file, not a directory",
    errno.ENOENT: "does not exist",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ELOOP: "is a symbolic link, which is never followed here",
    errno.ENXIO: "is a FIFO or a device with no one at the other end, not a file",
    errno.EEXIST: "is there already",
    errno.ENOTEMPTY: "is a directory that is not empty",
    errno.ENOSPC: "its file system is full",
    errno.EDQUOT: "the disk quota of this user is spent",
    errno.EROFS: "is on a read-only file system",
    errno.ENAMETOOLONG: "is a name too long for its file system",
    errno.EXDEV: "is on another file system",
    errno.EBUSY: "is busy",
    errno.ETXTBSY: "is a program that is running",
    errno.EMFILE: "cannot be opened: this process has too many files open",
    errno.ENFILE: "cannot be opened: the system has too many files open",
    errno.EIO: "an I/O error on its device",
    errno.EADDRINUSE: "is in use by another process",
    errno.EADDRNOTAVAIL: "is not an address of this host",
}


def os_words(error: OSError) -> str:
    """What an OSError says is wrong, in words for the person who has to act (no errno numbers, no Python reprs):
    "is a directory, not a file". The path is the caller's to name (`os_error_line`)."""
    if error.errno in _OS_WORDS:
        return _OS_WORDS[error.errno]
    text = " ".join(str(error.strerror or (error.args[-1] if error.args else "")).split())
    return text[:1].lower() + text[1:] if text else type(error).__name__


def os_error_line(error: OSError) -> str:
    """An OSError as one line: the path it is about (the destination of a rename or a link) and what is wrong."""
    path = error.filename2 if error.filename2 is not None else error.filename
    return f"{os.fsdecode(path)}: {os_words(error)}" if isinstance(path, (str, bytes)) else os_words(error)
