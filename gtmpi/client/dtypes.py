"""gtmpi's dtypes are torch's; numpy dtypes, Python types and names are accepted too."""
from __future__ import annotations

from typing import Any, Union

import numpy as np
import torch

float32, float16, bfloat16, float64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
int32, int64, bool_ = torch.int32, torch.int64, torch.bool
int8, int16, uint8 = torch.int8, torch.int16, torch.uint8
half, double, long = torch.float16, torch.float64, torch.int64

_PY = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


# what the API's dtype= takes: a torch dtype, a numpy one, a Python type or a name ('float32')
DTypeLike = Union[torch.dtype, np.dtype, type, str, None]


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
