"""A dry run's clock: how long each instruction would take on a named GPU, from a simple
per-op cost model (worker/metaplane.py advances a simulated worker's clock by it, so a dry
run's trace shows these durations).

An op takes the longer of its arithmetic at a share of the GPU's peak and its memory traffic
(operands read, results written) at a share of its memory bandwidth, plus a launch; a
collective moves its ring's bytes over the link, plus a latency. These are estimates of the
right order, not measurements: no overlap, no caches, no waiting for other workers.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..ops.table import Kind


class Gpu(NamedTuple):
    memory: int         # bytes
    half_flops: float   # dense bf16/fp16 tensor-core peak, per second
    float_flops: float  # float32 without TF32
    bandwidth: float    # memory, bytes per second
    link: float         # NVLink to one peer, bytes per second each way
    # what torch's allocator gives cuBLAS and cuBLASLt for their workspaces, once per stream
    # that runs a matrix product: on an H100 with torch 2.11 (cuBLAS 13.1), 32 + 1 MiB,
    # measured (2026-11-27); on an A100, torch's default configuration for it (not measured)
    blas_workspace: int = 33 * 2 ** 20
    capability: tuple[int, int] = (9, 0)  # what torch.cuda says of it in a dry run
    processors: int = 132


GPUS = {"H100": Gpu(80 * 2 ** 30, 989e12, 67e12, 3.35e12, 450e9),
        "H200": Gpu(141 * 2 ** 30, 989e12, 67e12, 4.8e12, 450e9),
        "A100": Gpu(80 * 2 ** 30, 312e12, 19.5e12, 2.0e12, 300e9, (8 * 2 ** 10 + 128 + 2 ** 10) * 2 ** 10,
                     (8, 0), 108)}

MATMUL_SHARE = 0.7   # of peak arithmetic that large matrix products reach
MEMORY_SHARE = 0.8   # of peak bandwidth that streaming kernels reach
LAUNCH_NS = 3_000    # a kernel launched outside a graph
COLLECTIVE_NS = 15_000  # a collective's latency
# the bytes a member moves over its link, as a multiple of the whole tensor's and (n-1)/n
RING = {"all_reduce": 2.0, "all_reduce_": 2.0, "all_reduce_bucket": 2.0, "all_gather": 1.0,
        "all_gather_many": 1.0, "gather_pieces_": 1.0, "reduce_scatter": 1.0,
        "reduce_scatter_bucket": 1.0, "all_to_all": 1.0}


def instruction_ns(name: str, kind: Kind | None, inputs: list[torch.Tensor],
                   outputs: list[torch.Tensor], gpu: Gpu, members: int) -> int:
    """Modeled nanoseconds of one instruction; 0 for control words (``kind`` None)."""
    if kind is None:
        return 0
    if kind is Kind.COMM:
        largest = max((t.numel() * t.element_size() for t in (*inputs, *outputs)), default=0)
        if name in ("send", "recv"):
            return COLLECTIVE_NS + int(largest / gpu.link * 1e9)
        n = max(members, 1)
        return COLLECTIVE_NS + int(largest * RING.get(name, 2.0) * (n - 1) / n / gpu.link * 1e9)
    read = {_storage(t) for t in inputs}
    made = [t for t in outputs if _storage(t) not in read]  # views of an operand move nothing
    if not made and not (kind is Kind.INPLACE and outputs):
        return 0
    moved = sum(t.numel() * t.element_size() for t in (*inputs, *(made or outputs)))
    flops = _flops(name, kind, inputs, outputs)
    # an autocast linear casts inside: its result (or its gradient's input) is half
    half = any(t.dtype in (torch.bfloat16, torch.float16) for t in (*inputs, *outputs))
    peak = (gpu.half_flops if half else gpu.float_flops) * MATMUL_SHARE
    return LAUNCH_NS + int(max(flops / peak, moved / (gpu.bandwidth * MEMORY_SHARE)) * 1e9)


def _flops(name: str, kind: Kind, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> float:
    """Multiply-adds times two of the matrix products in an op (elementwise work is left to
    the memory term)."""
    if name == "linear_grad" and len(inputs) >= 3:
        g, x = inputs[0], inputs[1]
        per_grad = 2.0 * g.numel() * x.shape[-1]  # each of dx and dW is one such product
        return per_grad * sum(1 for o in outputs if o.dim() >= 2)
    if kind is Kind.MATMUL and inputs and outputs:
        return 2.0 * sum(o.numel() for o in outputs) * inputs[0].shape[-1]
    if name.startswith("scaled_dot_product_attention") and inputs and inputs[0].dim() == 4:
        q = inputs[0]
        b, h, t, d = q.shape
        forward = 4.0 * b * h * t * t * d / 2  # causal: half the scores
        return forward * (2.5 if name.endswith("_grad") else 1.0)
    return 0.0


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def members_of(kw: dict | None, groups: dict[int, int]) -> int:
    """The size of a collective's group (its ``group`` keyword), 2 for a transfer."""
    if not kw or "group" not in kw:
        return 2
    return groups.get(kw["group"], 2)


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors among an instruction's results (a tensor, a tuple of them, or other)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []

