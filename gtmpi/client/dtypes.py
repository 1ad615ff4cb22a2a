"""gtmpi's dtypes are torch's; numpy dtypes, Python types and names are accepted too."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

float32, float16, bfloat16, float64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
int32, int64, bool_ = torch.int32, torch.int64, torch.bool
half, double, long = torch.float16, torch.float64, torch.int64

_PY = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def as_dtype(d: Any) -> torch.dtype | None:
    """torch.dtype for anything a user may pass as a dtype; None stays None (torch's default)."""
    if d is None or isinstance(d, torch.dtype):
        return d
    if d in _PY:
        return _PY[d]
    if isinstance(d, str) and hasattr(torch, d) and isinstance(getattr(torch, d), torch.dtype):
        return getattr(torch, d)
    try:
        return torch.from_numpy(np.empty(0, dtype=np.dtype(d))).dtype
    except TypeError:
        raise TypeError(f"not a dtype: {d!r}") from None


# torch dtypes numpy can hold: their bytes are viewed with numpy, without torch calls
NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    d: np.dtype(n) for d, n in [(torch.float32, "float32"), (torch.float64, "float64"),
                                (torch.float16, "float16"), (torch.int8, "int8"),
                                (torch.uint8, "uint8"), (torch.int16, "int16"),
                                (torch.int32, "int32"), (torch.int64, "int64"),
                                (torch.bool, "bool"), (torch.complex64, "complex64"),
                                (torch.complex128, "complex128")]}


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor (bfloat16 and 0-d tensors included).
    numpy's views cost a fraction of torch's, and reads are latency-bound."""
    if t.dtype in NUMPY_DTYPES:
        return t.numpy().reshape(-1).view(np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()
