"""Where a logical tensor lives: a mesh of worker ranks and how the tensor lies across it.

  R      replicate: every member holds the whole tensor
  S(d)   shard: member i holds the i-th piece along dim d (torch.tensor_split's sizes:
         uneven shards allowed, the first ones one longer)
  P      partial: every member holds a tensor of the whole shape; the tensor is their sum
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    mesh: tuple[int, ...]  # worker ranks, in order
    kind: str = "R"        # "R", "S" or "P"
    dim: int = 0           # the sharded dim, for S

    def __post_init__(self) -> None:
        if self.kind not in ("R", "S", "P"):
            raise ValueError(f"unknown placement type {self.kind!r}")

    def __str__(self) -> str:
        kind = f"S({self.dim})" if self.kind == "S" else self.kind
        return f"{kind} on workers {list(self.mesh)}"

    @property
    def spread(self) -> bool:
        return len(self.mesh) > 1

    def sizes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Each member's length along the sharded dim."""
        n, k = shape[self.dim], len(self.mesh)
        return tuple(n // k + (1 if i < n % k else 0) for i in range(k))

    def starts(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        sizes = self.sizes(shape)
        return tuple(sum(sizes[:i]) for i in range(len(sizes)))

    def local_shape(self, shape: tuple[int, ...], member: int) -> tuple[int, ...]:
        if self.kind != "S":
            return tuple(shape)
        local = list(shape)
        local[self.dim] = self.sizes(shape)[member]
        return tuple(local)


def replicated(rank: int) -> Placement:
    return Placement((rank,), "R")
