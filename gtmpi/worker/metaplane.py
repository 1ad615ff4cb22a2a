"""The data plane of a dry run (client/dryrun.py): the same kernels as worker/dataplane.py's
on meta tensors (shapes and dtypes, no data), so that the dispatcher's every collective and
transfer runs, is counted with its bytes as a real run counts it, and makes results of the
right shape; nothing moves and nobody waits."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch


class MetaPlane:
    backend = "meta"

    def __init__(self) -> None:
        self.stats: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # kind -> [count, bytes]
        self.started = False
        # what fused kernels pass to torch.distributed themselves (the vocabulary-parallel
        # cross-entropy's reductions skip meta tensors): no group exists
        self.groups: dict[int, None] = defaultdict(lambda: None)

    def init(self, backend: str) -> None:
        self.started = True

    def new_group(self, gid: int, ranks: tuple[int, ...]) -> None:
        pass

    def _count(self, kind: str, t: torch.Tensor) -> None:
        entry = self.stats[kind]
        entry[0] += 1
        entry[1] += t.numel() * t.element_size()

    def all_reduce(self, x: torch.Tensor, group: int, inplace: bool = False) -> torch.Tensor:
        y = x if inplace else x.clone()
        self._count("all_reduce", y)
        return y

    def all_reduce_async(self, x: torch.Tensor, group: int) -> None:
        self._count("all_reduce", x)

    def reduce_bucket(self, xs: tuple[torch.Tensor, ...], group: int) -> tuple[torch.Tensor, ...]:
        flat = torch.cat([x.reshape(-1) for x in xs])
        self._count("all_reduce", flat)
        return tuple(v.view(x.shape) for v, x in zip(flat.split([x.numel() for x in xs]), xs))

    def take_work(self) -> Any:
        return None

    def all_gather(self, x: torch.Tensor, group: int, dim: int, sizes: tuple[int, ...]) -> torch.Tensor:
        shape = list(x.shape)
        self._count("all_gather", x.new_empty([*shape[:dim], max(sizes), *shape[dim + 1:]]))
        shape[dim] = sum(sizes)
        return x.new_empty(shape)

    def reduce_scatter(self, x: torch.Tensor, group: int, dim: int, sizes: tuple[int, ...],
                       index: int) -> torch.Tensor:
        self._count("reduce_scatter", x)
        return x.narrow(dim, sum(sizes[:index]), sizes[index]).contiguous()

    def all_to_all(self, x: torch.Tensor, group: int, src: int, dst: int,
                   src_sizes: tuple[int, ...], dst_sizes: tuple[int, ...], index: int) -> torch.Tensor:
        self._count("all_to_all", x)
        shape = list(x.shape)
        shape[src], shape[dst] = sum(src_sizes), dst_sizes[index]
        return x.new_empty(shape)

    def agree(self, fault: Any, group: int) -> Any:
        self._count("agree", torch.zeros(1, dtype=torch.int32, device="meta"))
        return fault

    def send(self, x: torch.Tensor, dst: int) -> tuple:
        self._count("send", x)
        return ()

    def recv(self, shape: tuple, dtype: torch.dtype, src: int) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device="meta")
        self._count("recv", x)
        return x

    def held(self) -> dict[str, int]:
        return {"sends_in_flight": 0, "send_bytes_held": 0}

    def settle_sends(self) -> None:
        pass

    def begin_capture(self) -> None:
        pass

    def end_capture(self) -> None:
        pass

    def finish(self) -> None:
        pass
