"""gtmpi.save / gtmpi.load: torch's checkpoint format, so either side can read the other's.

save() reads every gtmpi tensor in ``obj`` (nested dicts, lists, tuples) into a CPU torch
tensor and calls torch.save; load() calls torch.load and makes every tensor it finds a gtmpi
tensor (held by the client until a worker needs it, as a CPU tensor of torch's).

A checkpoint is never half-written: save() writes a temporary file beside the path, flushes it
to the disk and renames it over the path, so a job killed at any moment leaves the previous
checkpoint or the new one, whole. torch's format is a zip archive with a CRC-32 per record,
which torch.load does not check (a flipped bit in a weight loads as a wrong weight, or a NaN):
load() checks every record first and names the damaged one.
"""
from __future__ import annotations

import copy
import os
import socket
import tempfile
import zipfile
from typing import IO, Any

import torch

from .client.creation import tensor
from .client.tensor import Tensor
from .transport.ending import alive, forget

_CHUNK = 1 << 24
_HOST = socket.gethostname().replace(".", "_")


def _map(obj: Any, fn, kind: type) -> Any:
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        # a copy keeps what a dict's subclass holds besides its items (a defaultdict's
        # factory); made from its items, a Counter counted the (key, count) pairs instead
        mapped = copy.copy(obj)
        for k, v in obj.items():
            mapped[k] = _map(v, fn, kind)
        return mapped
    if isinstance(obj, (list, tuple)):
        items = [_map(v, fn, kind) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def save(obj: Any, f: str | os.PathLike | IO[bytes], **torch_save_args: Any) -> None:
    """torch.save's arguments. A path is replaced whole or not at all; a file object is
    written as torch.save writes it."""
    data = _map(obj, lambda t: t.cpu_torch().clone(), Tensor)
    if not isinstance(f, (str, os.PathLike)):
        torch.save(data, f, **torch_save_args)
        return
    path = os.path.abspath(os.fspath(f))
    folder, name = os.path.split(path)
    if not os.path.isdir(folder):  # torch's error, not one naming the temporary file
        raise RuntimeError(f"Parent directory {os.path.dirname(os.fspath(f)) or '.'} does not "
                           "exist.")
    _forget_killed_saves(folder, name)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.{_HOST}.{os.getpid()}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            torch.save(data, out, **torch_save_args)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        forget(tmp)
        raise
    _fsync_folder(folder)


def _forget_killed_saves(folder: str, name: str) -> None:
    """Remove the temporary files that saves of ``name`` killed on this host left behind (their
    names carry the host and the pid that wrote them; one still running is left alone)."""
    stem = f".{name}.{_HOST}."
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for other in names:
        if other.startswith(stem) and other.endswith(".tmp"):
            pid = other[len(stem):].split(".", 1)[0]
            if pid.isdigit() and not alive(int(pid)):
                forget(os.path.join(folder, other))


def _mode_for(path: str) -> int:
    """The mode torch.save's open() would give a new file (mkstemp's is private), or the
    replaced file's own."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def _fsync_folder(folder: str) -> None:
    """The rename itself on the disk: without it a power cut may bring the old name back."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a file system that cannot sync a folder
    finally:
        os.close(fd)


def verify(path: str | os.PathLike) -> None:
    """Raise RuntimeError naming the first record of a torch zip checkpoint whose bytes are
    not the ones written (their CRC-32 differs), or if the archive itself is damaged. A file
    in torch's legacy (non-zip) format has no checksums and passes."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        raise RuntimeError(f"gtmpi.load: {path} is empty (a save that never wrote it)")
    if not zipfile.is_zipfile(path):
        if head == b"PK\x03\x04":
            raise RuntimeError(f"gtmpi.load: {path} is damaged: a zip archive without its end "
                               "(cut short)")
        return
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info) as record:  # read to its end, it checks the CRC-32
                    while record.read(_CHUNK):
                        pass
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        raise RuntimeError(f"gtmpi.load: {path} is damaged (a changed byte, or a partial copy): "
                           f"{e}") from e


def load(path: str | os.PathLike, map_location: Any = None, weights_only: bool = True,
         mmap: bool | None = None, **pickle_load_args: Any) -> Any:
    """torch.load's arguments; map_location is accepted and moves nothing (where tensors live
    is the runtime's choice). Every record's checksum is checked first (verify)."""
    if isinstance(path, (str, os.PathLike)):
        verify(path)
    return _map(torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap,
                           **pickle_load_args), tensor, torch.Tensor)
