"""A node of the autograd graph: one recorded op, what its gradient rule reads (grads.py) and
what the engine walks (engine.py)."""
from __future__ import annotations

from typing import Any, Iterator


# backward names of torch's where they are not the op's own name in CamelCase
_TORCH_NAMES = {"cross_entropy": "NllLossBackward0", "layer_norm": "NativeLayerNormBackward0",
                "to": "ToCopyBackward0", "reshape": "ViewBackward0", "flatten": "ViewBackward0",
                "contiguous": "CloneBackward0", "alias": "AliasBackward0",
                "clamp": "ClampBackward1", "max_dim": "MaxBackward0", "min_dim": "MinBackward0",
                "vector_norm": "LinalgVectorNormBackward0", "getitem": "IndexBackward0",
                "masked_scale": "NativeDropoutBackward0"}


class Node:
    """One recorded op: its name, operands (tensors, Ghosts of those its rule does not read,
    and constants), keyword constants and what its rule saved; ``outputs`` is the number of
    results."""

    __slots__ = ("op", "operands", "kw", "outputs", "saved", "freed", "results", "backward",
                 "uses", "versions", "__weakref__")

    def __init__(self, op: str, operands: tuple, kw: dict | None, outputs: int, saved: Any):
        self.op, self.operands, self.kw, self.outputs, self.saved = op, operands, kw, outputs, saved
        self.freed = False
        self.results: tuple = ()  # (id, (shape, dtype)) per output, for print_tape
        self.backward: str | None = None  # the signal its gradient ops run under
        # per result: how many recorded ops read it. A result read once gets its whole gradient
        # from that one op, so the op may finish it at once (linear's partial sums, summed
        # while the weight's gradient computes) instead of leaving it to be added to others
        self.uses = [0] * outputs
        # of each operand kept whole (a tensor the rule reads), its _version now: an in-place
        # op under autograd since makes it another value, which the rule must not read
        self.versions = tuple(getattr(a, "_version", None) for a in operands)

    def name(self) -> str:
        """torch's name for the backward of this op (``AddBackward0``), as torch's own kernels
        for the same call would be named."""
        dims = [len(a.shape) for a in self.operands if hasattr(a, "shape")]
        if self.op == "matmul":
            return "MmBackward0" if dims == [2, 2] else "UnsafeViewBackward0"
        if self.op == "linear":
            two_d, bias = dims[0] == 2, len(dims) == 3
            return ("AddmmBackward0" if bias else "MmBackward0") if two_d else \
                ("ViewBackward0" if bias else "UnsafeViewBackward0")
        return _TORCH_NAMES.get(self.op) or \
            self.op.replace("true", "").title().replace("_", "") + "Backward0"

    def __repr__(self) -> str:
        return f"<{self.name()} object at {id(self):#x}>"

    def parents(self) -> Iterator[Node]:
        for a in self.operands:
            node = getattr(a, "_node", None)
            if node is not None:
                yield node
