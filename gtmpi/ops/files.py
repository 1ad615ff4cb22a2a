"""The kernels of a sharded checkpoint (gtmpi/sharded.py): each worker writes the pieces it
holds to a file of its own, and fills the pieces it holds from whichever files overlap them,
so that no tensor passes through rank 0 and a checkpoint loads onto any layout."""
from __future__ import annotations

import os
from functools import lru_cache

import torch


def save_pieces(*pieces: torch.Tensor, path: str, keys: tuple[str, ...],
                rank: int) -> torch.Tensor:
    """This worker's ``pieces`` under ``keys`` in ``{path}.rank{rank}.pt``, on the disk when
    this returns (written aside, flushed, renamed); their bytes, as an int64 count."""
    if pieces[0].device.type == "meta":  # a dry run writes nothing
        return torch.zeros(1, dtype=torch.int64, device=pieces[0].device)
    data = {k: p.detach().contiguous().cpu() for k, p in zip(keys, pieces)}
    final = f"{path}.rank{rank}.pt"
    with open(final + ".tmp", "wb") as f:
        torch.save(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(final + ".tmp", final)
    return torch.tensor([sum(t.nbytes for t in data.values())], dtype=torch.int64,
                        device=pieces[0].device)


def load_piece_(target: torch.Tensor, sources: tuple, regions: tuple, rank: int) -> torch.Tensor:
    """``target``, this worker's piece of a tensor (``regions``: (rank, starts, shape) of
    every member's piece within the whole), filled from the saved pieces that overlap it:
    ``sources`` = ((file, key, starts, shape), ...), each file opened once, mapped, not read
    whole."""
    if target.device.type == "meta":
        return target
    mine = next((starts, shape) for r, starts, shape in regions if r == rank)
    for file, key, starts, shape in sources:
        lo = [max(a, b) for a, b in zip(starts, mine[0])]
        hi = [min(a + n, b + m) for a, n, b, m in zip(starts, shape, *mine)]
        if any(h <= low for low, h in zip(lo, hi)):
            continue  # no overlap
        src = _opened(file, os.path.getmtime(file))[key]
        dst = target
        for d, (low, h) in enumerate(zip(lo, hi)):
            src = src.narrow(d, low - starts[d], h - low)
            dst = dst.narrow(d, low - mine[0][d], h - low)
        dst.copy_(src)
    return target


@lru_cache(maxsize=64)
def _opened(file: str, mtime: float) -> dict:
    """A saved file's tensors, memory-mapped (a load reads each file once for all the tensors
    it fills, a file per saving worker and group: as many as a large job writes; ``mtime``
    keeps a file written again from being served stale)."""
    return torch.load(file, mmap=True, weights_only=True)
