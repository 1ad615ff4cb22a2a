"""gtmpi.save / gtmpi.load: torch's checkpoint format, so either side can read the other's.

save() reads every gtmpi tensor in ``obj`` (nested dicts, lists, tuples) into a CPU torch
tensor and calls torch.save; load() calls torch.load and uploads every tensor it finds.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from .client.creation import tensor
from .client.tensor import Tensor


def _map(obj: Any, fn, kind: type) -> Any:
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map(v, fn, kind)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn, kind) for v in obj)
    return obj


def save(obj: Any, path: str | os.PathLike) -> None:
    torch.save(_map(obj, lambda t: t.cpu_torch().clone(), Tensor), path)


def load(path: str | os.PathLike, map_location: Any = None, weights_only: bool = True,
         mmap: bool | None = None, **pickle_load_args: Any) -> Any:
    """torch.load's arguments; map_location is accepted and moves nothing (where tensors live
    is the runtime's choice): every tensor read is uploaded to the workers."""
    return _map(torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap,
                           **pickle_load_args), tensor, torch.Tensor)
