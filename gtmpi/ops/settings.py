"""torch's process-wide kernel settings that a program may change (nanoGPT sets TF32 first
thing): applied on every worker, where the kernels run, and on rank 0. gtmpi.backends and
gtmpi.set_float32_matmul_precision send them; a worker applies them at the same point of its
stream, so the kernels issued after the setting run with it."""
from __future__ import annotations

from typing import Any

import torch

NAMES = ("cuda.matmul.allow_tf32", "cudnn.allow_tf32", "cudnn.benchmark",
         "cudnn.deterministic", "float32_matmul_precision")


def apply(name: str, value: Any) -> None:
    if name == "float32_matmul_precision":
        torch.set_float32_matmul_precision(value)
    elif name == "cuda.matmul.allow_tf32":
        torch.backends.cuda.matmul.allow_tf32 = bool(value)
    elif name in NAMES:
        setattr(torch.backends.cudnn, name.split(".")[1], bool(value))
    else:
        raise ValueError(f"unknown backend setting {name!r}: one of {', '.join(NAMES)}")


def current(name: str) -> Any:
    if name == "float32_matmul_precision":
        return torch.get_float32_matmul_precision()
    if name == "cuda.matmul.allow_tf32":
        return torch.backends.cuda.matmul.allow_tf32
    return getattr(torch.backends.cudnn, name.split(".")[1])
