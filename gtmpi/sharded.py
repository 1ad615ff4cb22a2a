"""Sharded checkpoints: gtmpi.save_sharded(obj, folder) and gtmpi.load_sharded(obj, folder).

Each worker writes the pieces it holds to a file of its own (ops/files.py), so no tensor
passes through rank 0: a replicated tensor is first cut along dim 0 where it lies (its
replicas write one piece each, no copy twice), a split one writes its pieces as they are.
Rank 0 writes one index: for every tensor of ``obj`` its shape, dtype and where each piece
lies in the whole, and in which file; the rest of ``obj`` (numbers, strings, nesting) as it is.

load_sharded fills the gtmpi tensors of ``obj`` (a model's ``state_dict()``, an optimizer's,
or any nesting of them) in place, each worker the pieces it holds, from whichever saved
pieces overlap them: a checkpoint written by 4 workers in one layout loads onto 2 in another.

A save never destroys the last one: its files carry a name of their own, the index is written
aside and renamed over the old one only once every worker's file is on the disk, and only then
are the old files removed. A job killed at any moment leaves the old checkpoint or the new one.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from .client.runtime import runtime
from .client.tensor import Tensor, apply
from .placement.types import Placement

INDEX = "index.json"
INLINE = 1024  # the most elements of a torch tensor the index holds itself


def save_sharded(obj: Any, folder: str | os.PathLike) -> None:
    """Every gtmpi tensor of ``obj`` (nested dicts, lists, tuples) written by the workers that
    hold it, one file per worker and group of tensors laid out alike, and an index."""
    folder = os.path.abspath(os.fspath(folder))
    rt = runtime()
    _not_served(rt, "save_sharded")
    dry = rt.dry_run is not None
    if not dry:
        os.makedirs(folder, exist_ok=True)
    placer = rt.dispatcher.placer
    tag = f"{int(time.time() * 1e6):x}-{os.getpid()}"  # this save's files, apart from the last
    found: list[tuple[str, Tensor]] = []
    layout = _walk(obj, "", found)
    pieces = [(key, _one_piece_each(t)) for key, t in found]
    groups = rt.alike([p.id for _, p in pieces], [None] * len(pieces))
    entries, files, counts = {}, set(), []
    for g, group in enumerate(groups):
        path = os.path.join(folder, f"{tag}.{g}")
        keys = tuple(pieces[i][0] for i in group)
        where = placer.placement(pieces[group[0]][1].id)
        # (rank: where the placer does not place, as for one worker; else each member's own)
        counts.append(apply("save_pieces", *(pieces[i][1] for i in group), path=path,
                            keys=keys, rank=where.mesh[0]))
        for i in group:
            key, piece = pieces[i]
            shape = tuple(piece.shape)
            entries[key] = {"shape": list(shape), "dtype": str(piece.dtype).removeprefix("torch."),
                            "pieces": [{**r, "file": f"{tag}.{g}.rank{r['rank']}.pt"}
                                       for r in _regions(where, shape)]}
            files.update(p["file"] for p in entries[key]["pieces"])
    # every worker's file written and flushed (ops/files.py), or its error raised here: the
    # members agree, so the first member's count fails if any member's write did
    rt.agree([c.id for c in counts])
    for count in counts:
        count.tolist()
    if dry:
        return  # simulated workers: what a save costs them counted, no file written
    missing = [f for f in sorted(files) if not os.path.exists(os.path.join(folder, f))]
    if missing:
        raise RuntimeError(f"gtmpi.save_sharded: worker files {', '.join(missing)} are not in "
                           f"{folder}: the workers must write where rank 0 reads (a shared "
                           "file system); the last checkpoint there is untouched")
    index = {"format": "gtmpi-sharded-1", "tensors": entries, "layout": layout}
    tmp = os.path.join(folder, f".{INDEX}.{tag}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(index, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, INDEX))
    for name in os.listdir(folder):  # the last save's files, now that the index is the new one
        if name.endswith(".pt") and name.split(".")[0] != tag:
            os.remove(os.path.join(folder, name))


def _not_served(rt: Any, what: str) -> None:
    """A server's workers write and read no file a client names (server/__init__.py)."""
    if rt.dispatcher.rounds is not None:
        raise RuntimeError(f"gtmpi.{what}: the workers of a server do not touch files on their "
                           "hosts for a client; gtmpi.save and gtmpi.load work on this "
                           "program's own host")


def load_sharded(obj: Any, folder: str | os.PathLike) -> None:
    """Fill every gtmpi tensor of ``obj`` in place from the checkpoint in ``folder`` (keys by
    their place in ``obj``, as save_sharded named them), whatever layout each has now."""
    folder = os.path.abspath(os.fspath(folder))
    _not_served(runtime(), "load_sharded")
    try:
        with open(os.path.join(folder, INDEX), encoding="utf-8") as f:
            index = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"gtmpi.load_sharded: no checkpoint in {folder} (its "
                                f"{INDEX} is missing)") from None
    saved = index["tensors"]
    found: list[tuple[str, Tensor]] = []
    _walk(obj, "", found)
    placer = runtime().dispatcher.placer
    for key, t in found:
        entry = saved.get(key)
        if entry is None:
            raise KeyError(f"gtmpi.load_sharded: {key!r} is not in the checkpoint in {folder}")
        if list(t.shape) != entry["shape"]:
            raise ValueError(f"gtmpi.load_sharded: {key!r} has shape {tuple(t.shape)} here and "
                             f"{tuple(entry['shape'])} in the checkpoint")
        sources = tuple((os.path.join(folder, p["file"]), key, tuple(p["starts"]),
                         tuple(p["shape"])) for p in entry["pieces"])
        where = placer.placement(t.id)
        shape = tuple(t.shape)
        regions = tuple((r["rank"], tuple(r["starts"]), tuple(r["shape"]))
                        for r in _regions(where, shape))
        with torch.no_grad():
            apply("load_piece_", t, sources=sources, regions=regions, rank=where.mesh[0])
    _restore(obj, index["layout"])


def _restore(obj: Any, saved: dict) -> Any:
    """``obj``'s values that are not gtmpi tensors set to the saved ones, in place where
    ``obj`` can change (dicts and lists); the saved value of such a leaf."""
    if "value" in saved:
        return saved["value"]
    if "torch" in saved:
        return torch.tensor(saved["torch"], dtype=getattr(torch, saved["dtype"]))
    if not _holds_tensors(saved):  # plain values (a list of losses): as saved, whatever obj had
        if "dict" in saved:
            return {k: _restore(None, sub) for k, sub in saved["dict"]}
        kind = "list" if "list" in saved else "tuple"
        values = [_restore(None, sub) for sub in saved[kind]]
        return values if kind == "list" else tuple(values)
    if "dict" in saved and isinstance(obj, dict):
        for key, sub in saved["dict"]:
            if "tensor" not in sub:
                obj[key] = _restore(obj.get(key), sub)
            elif key in obj:
                _restore(obj[key], sub)
    for kind in ("list", "tuple"):
        if kind in saved and isinstance(obj, (list, tuple)):
            for i, sub in enumerate(saved[kind]):
                value = _restore(obj[i] if i < len(obj) else None, sub)
                if "tensor" not in sub and isinstance(obj, list) and i < len(obj):
                    obj[i] = value
    return obj


def _holds_tensors(saved: dict) -> bool:
    """Whether a saved layout has a gtmpi tensor anywhere in it."""
    if "tensor" in saved:
        return True
    subs = [sub for _, sub in saved.get("dict", ())] + saved.get("list", []) + \
        saved.get("tuple", [])
    return any(_holds_tensors(sub) for sub in subs)


def _walk(obj: Any, prefix: str, found: list) -> Any:
    """``obj`` with each gtmpi tensor replaced by its key (its path in ``obj``), collected in
    ``found``; what json cannot hold is refused."""
    if isinstance(obj, Tensor):
        found.append((prefix, obj))
        return {"tensor": prefix}
    if isinstance(obj, dict):
        return {"dict": [[k, _walk(v, f"{prefix}/{k}", found)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [_walk(v, f"{prefix}/{i}", found) for i, v in enumerate(obj)]}
    if isinstance(obj, torch.Tensor):  # small host values (an optimizer's step): inline
        if obj.numel() > INLINE:
            raise TypeError(f"gtmpi.save_sharded: {prefix} is a torch tensor of {obj.numel()} "
                            f"elements; the workers write gtmpi tensors, the index holds torch "
                            f"tensors of up to {INLINE}")
        return {"torch": obj.tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise TypeError(f"gtmpi.save_sharded: {prefix or 'the object'} is a {type(obj).__name__}; "
                    "a sharded checkpoint holds tensors, numbers, strings and their nesting")


def _one_piece_each(t: Tensor) -> Tensor:
    """``t`` laid out so that each worker holding it has a piece no other has where it can be:
    a replicated tensor cut along dim 0 where it lies (no communication); a partial sum
    summed first."""
    placer = runtime().dispatcher.placer
    piece = t.detach()
    where = placer.placement(t.id)
    if any(kind in "PV" for kind, _ in where.per_axis()):
        where = Placement(where.mesh, "R")
        placer.place(piece.id, piece._sig, where, "a sharded checkpoint")
    if where.kind == "R" and len(where.mesh) > 1 and t.dim() and t.shape[0] >= len(where.mesh):
        placer.place(piece.id, piece._sig, Placement(where.mesh, "S", 0), "a sharded checkpoint")
    return piece


def _regions(where: Placement, shape: tuple[int, ...]) -> list[dict]:
    """Where each member's piece lies in the whole: its starts and shape per dim; replicas of
    one piece are listed once each."""
    out = []
    for m, rank in enumerate(where.mesh):
        starts = [0] * len(shape)
        local = list(shape)
        for dim, start, length in where.piece(shape, m):
            starts[dim], local[dim] = start, length
        out.append({"rank": rank, "starts": starts, "shape": local})
    return out
