"""Where a logical tensor lives: a mesh of worker ranks and how the tensor lies across it.

Per mesh axis, one of
  R      replicate: the members along the axis hold the same values
  S(d)   shard: member i along the axis holds the i-th piece along dim d (torch.tensor_split's
         sizes: uneven shards allowed, the first ones one longer)
  P      partial: the members along the axis hold tensors of the same shape that sum to it
  I      invariant: identical copies of one logical computation (the same values as R; its
         gradient is I, not a partial sum, where R's would be)
  V      varying: per-member values with no global meaning (a per-worker random mask, local
         statistics); they meet only R, I and V, and are read or moved only as partial sums

A mesh of one axis (the common case: ``Placement((1, 2), "S", 0)``) has ``kind`` and ``dim``;
a named mesh of several axes (dp × tp) has its axis sizes in ``grid`` and one (kind, dim) per
axis in ``axes``, its ranks listed row-major.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True, eq=False)
class Placement:
    mesh: tuple[int, ...]  # worker ranks, in order (row-major over the axes)
    kind: str = "R"        # one axis: "R", "I", "S", "P" or "V"; several axes: "grid"
    dim: int = 0           # the sharded dim, for S
    grid: tuple[int, ...] = ()               # several axes: their sizes
    axes: tuple[tuple[str, int], ...] = ()   # several axes: (kind, dim) each

    def __post_init__(self) -> None:
        if self.kind not in ("R", "I", "S", "P", "V", "grid"):
            raise ValueError(f"unknown placement type {self.kind!r}")
        # the dispatcher compares and hashes placements several times per op (plan keys,
        # copies): the fields' tuple once, not at every comparison
        object.__setattr__(self, "_key", (self.mesh, self.kind, self.dim, self.grid, self.axes))
        object.__setattr__(self, "_hash", hash(self._key))

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is Placement and self._hash == other._hash
                                 and self._key == other._key)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:  # a string's hash differs between processes
        return (Placement, self._key)

    def __str__(self) -> str:
        types = "×".join(_name(k, d) for k, d in self.per_axis())
        shape = f" as {'×'.join(map(str, self.grid))}" if self.grid else ""
        return f"{types} on workers {list(self.mesh)}{shape}"

    # the axes ---------------------------------------------------------------------------

    def per_axis(self) -> tuple[tuple[str, int], ...]:
        return self.axes if self.grid else ((self.kind, self.dim),)

    def shape(self) -> tuple[int, ...]:
        return self.grid or (len(self.mesh),)

    def coords(self, member: int) -> tuple[int, ...]:
        """A member's position along each axis."""
        out = []
        for size in reversed(self.shape()):
            out.append(member % size)
            member //= size
        return tuple(reversed(out))

    def along(self, axis: int, member: int) -> tuple[int, ...]:
        """The ranks on ``member``'s line along ``axis`` (its group for that axis)."""
        c = list(self.coords(member))
        line = []
        for i in range(self.shape()[axis]):
            c[axis] = i
            line.append(self.mesh[_index(c, self.shape())])
        return tuple(line)

    @property
    def whole(self) -> "Placement":
        """Replicated on the same mesh."""
        return Placement(self.mesh, "R")

    # pieces -----------------------------------------------------------------------------

    def sizes(self, shape: tuple[int, ...], axis: int = 0) -> tuple[int, ...]:
        """Lengths along the dim sharded by ``axis``, per position along it."""
        kind, dim = self.per_axis()[axis]
        return _split(shape[dim], self.shape()[axis])[0]

    def starts(self, shape: tuple[int, ...], axis: int = 0) -> tuple[int, ...]:
        kind, dim = self.per_axis()[axis]
        return _split(shape[dim], self.shape()[axis])[1]

    def piece(self, shape: tuple[int, ...], member: int) -> list[tuple[int, int, int]]:
        """(dim, start, length) of each sharded dim of a member's piece."""
        coords = self.coords(member)
        return [(dim, self.starts(shape, a)[coords[a]], self.sizes(shape, a)[coords[a]])
                for a, (kind, dim) in enumerate(self.per_axis()) if kind == "S"]

    def local_shape(self, shape: tuple[int, ...], member: int) -> tuple[int, ...]:
        local = list(shape)
        for dim, _, length in self.piece(shape, member):
            local[dim] = length
        return tuple(local)


def make(mesh: tuple[int, ...], grid: tuple[int, ...], axes: list[tuple[str, int]]) -> Placement:
    """The placement with these per-axis types: one-axis form where it can be."""
    axes = [(k, d if k == "S" else 0) for k, d in axes]
    if not grid or len(grid) == 1:
        (kind, dim), = axes
        return Placement(tuple(mesh), kind, dim)
    if all(k == "R" for k, _ in axes) or all(k == "I" for k, _ in axes):
        return Placement(tuple(mesh), axes[0][0])
    return Placement(tuple(mesh), "grid", 0, tuple(grid), tuple(axes))


def _name(kind: str, dim: int) -> str:
    return f"S({dim})" if kind == "S" else kind


@lru_cache(maxsize=4096)
def _split(n: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, starts) of n rows cut into k pieces, the first n % k one row longer: asked for
    every parameter at every ZeRO step, by few distinct (n, k)."""
    sizes = tuple(n // k + (1 if i < n % k else 0) for i in range(k))
    return sizes, tuple(sum(sizes[:i]) for i in range(k))


def _index(coords: list[int], shape: tuple[int, ...]) -> int:
    index = 0
    for c, size in zip(coords, shape):
        index = index * size + c
    return index
