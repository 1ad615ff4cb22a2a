"""Raw tensor bytes as MPI buffers: client<->worker bytes (uploads, reads) are never pickled."""
from __future__ import annotations

import numpy as np
import torch

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
