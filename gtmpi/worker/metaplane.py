"""A dry run's worker (client/dryrun.py): an executor on meta tensors (shapes and dtypes, no
data) that measures the memory a GPU would need, and a data plane with the same kernels as
worker/dataplane.py's, so that the dispatcher's every collective and transfer runs, is
counted with its bytes as a real run counts it, and makes results of the right shape; nothing
moves and nobody waits."""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .executor import Executor


REPLAYS_METERED = 3  # of each program, run as a real worker runs them


class MetaExecutor(Executor):
    """An executor whose peak is what a GPU's allocator would see: the most bytes alive at
    once of the tensors its kernels made, counted as torch's aten ops make them and as their
    storages die (torch keeps one Python object per storage while anything holds it, tensors
    that autograd saved too), so a fused kernel's temporaries count, as the gradient of the
    logits inside a cross-entropy's backward does."""

    def __init__(self, rank: int, link: Any) -> None:
        super().__init__(rank, torch.device("meta"), link)
        self.plane = MetaPlane()
        self._made = _Made()
        self._replays: dict[int, int] = {}  # program -> replays run
        # program -> what one replay did: (instructions, collectives by kind as (count,
        # bytes), (shape, stride, dtype) of each tensor that outlives it)
        self._effects: dict[int, tuple] = {}

    @property
    def meta_peak(self) -> int:
        return self._made.peak

    def _replay(self, out, args: tuple) -> None:
        # a program's replays make and free the same tensors and run the same collectives each
        # time: its first ones are run (and give its peak); later ones, where no trace records
        # instructions, only make the tensors that outlive it and count what it ran (torch's
        # meta kernels cost tens of µs an op: a training loop's dry run would take minutes)
        key, renames = args[0], args[2]
        runs = self._replays[key] = self._replays.get(key, 0) + 1
        known = self._effects.get(key)
        if runs <= REPLAYS_METERED or known is None or self.trace is not None:
            ops, comms = self.stats["ops"], {k: tuple(v) for k, v in self.plane.stats.items()}
            super()._replay(out, args)
            self._effects[key] = (
                self.stats["ops"] - ops,
                {k: (n - comms.get(k, (0, 0))[0], b - comms.get(k, (0, 0))[1])
                 for k, (n, b) in self.plane.stats.items()},
                [None if not isinstance(self.env.get(new), torch.Tensor) else
                 (self.env[new].shape, self.env[new].stride(), self.env[new].dtype)
                 for _, new in renames])
            return
        ops, comms, made = known
        self.stats["ops"] += ops
        for kind, (n, nbytes) in comms.items():
            entry = self.plane.stats[kind]
            entry[0] += n
            entry[1] += nbytes
        for (_, new), like in zip(renames, made):
            if like is not None:
                t = self.env[new] = torch.empty_strided(like[0], like[1], dtype=like[2],
                                                        device="meta")
                if self._made.active:
                    self._made.count(t)

    def _execute(self, batch: list[tuple]) -> None:
        if self._made.active:  # a replayed program, run by an instruction of the batch
            super()._execute(batch)
            return
        self._made.active = True
        try:
            with self._made:
                super()._execute(batch)
        finally:
            self._made.active = False


class _Made(TorchDispatchMode):
    """Bytes of the meta storages that aten ops made (not views, not results written in place)
    while they live, and their most at once."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.alive = self.peak = 0
        self._counted: weakref.WeakSet = weakref.WeakSet()  # the storages counted, while alive

    def count(self, t: torch.Tensor) -> None:
        """``t``'s storage is alive until it dies (once, however many tensors share it)."""
        storage = t.untyped_storage()
        if storage in self._counted:
            return
        self._counted.add(storage)
        nbytes = storage.nbytes()
        self.alive += nbytes
        self.peak = max(self.peak, self.alive)
        weakref.finalize(storage, self._freed, nbytes)

    def _freed(self, nbytes: int) -> None:
        self.alive -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for i, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.is_meta and i < len(returns) and \
                    returns[i].alias_info is None:
                self.count(t)
        return out


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
