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


# An upload's bytes travel as messages of at most this many bytes, in order, cut the same way
# at both ends (upload_pieces): a GPU worker receives a large upload into a small pinned
# buffer it reuses, a piece at a time, and copies each piece to the GPU while the next one
# arrives. MPI moves bytes into a fresh pinned buffer at less than half the rate it moves them
# into one it has written before (2.7-3.5 against 6.2 GB/s on one H200's host, 2026-12-04).
UPLOAD_PIECE_BYTES = 32 << 20


def upload_pieces(nbytes: int) -> list[tuple[int, int]]:
    """The (start, stop) byte ranges an upload of ``nbytes`` travels in: one message each,
    one for an empty upload too."""
    return [(a, min(a + UPLOAD_PIECE_BYTES, nbytes))
            for a in range(0, max(nbytes, 1), UPLOAD_PIECE_BYTES)]
