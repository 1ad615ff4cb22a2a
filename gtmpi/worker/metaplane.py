"""A dry run's worker (client/dryrun.py): an executor on meta tensors (shapes and dtypes, no
data) that measures the memory a GPU would need, and a data plane with the same kernels as
worker/dataplane.py's, so that the dispatcher's every collective and transfer runs, is
counted with its bytes as a real run counts it, and makes results of the right shape; nothing
moves and nobody waits."""
from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..ops.table import OPS, Kind, views_of
from . import costmodel
from .dataplane import bucket_rows
from .devicequery import DeviceQueries
from .executor import Executor


REPLAYS_METERED = 3  # of each program, run as a real worker runs them


class MetaExecutor(Executor):
    """An executor whose peak is what a GPU's allocator would see: the most bytes alive at
    once of the tensors its kernels made, counted as torch's aten ops make them and as their
    storages die (torch keeps one Python object per storage while anything holds it, tensors
    that autograd saved too), so a fused kernel's temporaries count, as the gradient of the
    logits inside a cross-entropy's backward does. Its clock (what a trace is stamped with)
    advances by each instruction's modeled time on ``gpu`` (worker/costmodel.py).

    What a GPU worker's allocator holds besides its tensors is modeled too: cuBLAS's workspace
    on each stream that runs a matrix product (the worker's own from its first, and, once a
    program is captured as a CUDA graph, the capture's stream's), and every send's snapshot
    (worker/dataplane.py), held until the send is done, which in a program being captured is
    the capture's end. A dry run's worker cannot capture: it runs that replay op by op, as a
    worker whose capture failed does, with the capture's memory."""

    def __init__(self, rank: int, link: Any, gpu: costmodel.Gpu = costmodel.GPUS["H100"],
                 workers: int = 1) -> None:
        super().__init__(rank, torch.device("meta"), link)
        self.plane = MetaPlane(workers)
        self.gpu = gpu
        name = next((k for k, v in costmodel.GPUS.items() if v is gpu), "GPU")
        self._control["device"] = DeviceQueries(self.device, link.reply, {
            "name": f"{name} (simulated)", "total_memory": gpu.memory, "major": gpu.capability[0],
            "minor": gpu.capability[1], "multi_processor_count": gpu.processors,
            "bf16": True}).run
        self._modeled = time.perf_counter_ns()
        self.now = lambda: self._modeled
        self._made = _Made()
        self._workspaces: list[torch.Tensor] = []  # one per stream that ran a matrix product
        self._replays: dict[int, int] = {}  # program -> replays run
        # program -> what one replay did: (instructions, collectives by kind as (count,
        # bytes), (shape, stride, dtype) of each tensor that outlives it, modeled ns)
        self._effects: dict[int, tuple] = {}

    @property
    def meta_peak(self) -> int:
        return self._made.peak

    def memory(self) -> dict[str, int]:
        """As a GPU worker's: tensor bytes held and at peak (the modeled GPU's)."""
        return {**super().memory(), "peak_bytes": self.meta_peak}

    def _replay(self, out, args: tuple) -> None:
        # a program's replays make and free the same tensors and run the same collectives each
        # time: its first ones are run (and give its peak); later ones, where no trace records
        # instructions, only make the tensors that outlive it and count what it ran (torch's
        # meta kernels cost tens of µs an op: a training loop's dry run would take minutes)
        key, renames = args[0], args[2]
        if args[3] == "capture":  # a GPU captures it on a stream of its own
            self._workspace(2)
        runs = self._replays[key] = self._replays.get(key, 0) + 1
        known = self._effects.get(key)
        # a growing call's replay (a sixth item, its size) makes tensors of new shapes
        if runs <= REPLAYS_METERED or known is None or self.trace is not None or \
                len(args) > 5 and args[5] is not None:
            ops, comms = self.stats["ops"], {k: tuple(v) for k, v in self.plane.stats.items()}
            began = self._modeled
            super()._replay(out, args)
            self._effects[key] = (
                self.stats["ops"] - ops,
                {k: (n - comms.get(k, (0, 0))[0], b - comms.get(k, (0, 0))[1])
                 for k, (n, b) in self.plane.stats.items()},
                [_left(self.env, new) for _, new in renames],
                self._modeled - began)
            return
        ops, comms, made, modeled = known
        self.stats["ops"] += ops
        self._modeled += modeled
        for kind, (n, nbytes) in comms.items():
            entry = self.plane.stats[kind]
            entry[0] += n
            entry[1] += nbytes
        for (_, new), left in zip(renames, made):
            if left is _ABSENT:
                continue
            if type(left) is _Value:  # what a fused op's meta kernel keeps for backward
                self.env[new] = left.value
                continue
            t = self.env[new] = torch.empty_strided(*left[:2], dtype=left[2], device="meta")
            if self._made.active:
                self._made.count(t)

    def _commit(self, out, args: tuple) -> None:
        # the capture refused here (meta has no graphs) is run op by op, holding every send's
        # snapshot to its end as the capture does
        self.plane.holding = True
        try:
            super()._commit(out, args)
        finally:
            self.plane.holding = False
            self.plane.settle_sends()

    def _workspace(self, streams: int) -> None:
        """cuBLAS's workspaces of ``streams`` streams, made once each, held for good."""
        while len(self._workspaces) < streams:
            ws = torch.empty(self.gpu.blas_workspace, dtype=torch.uint8, device="meta")
            self._made.count(ws)
            self._workspaces.append(ws)

    def run(self, batch: list[tuple]) -> None:
        # a batch starts no earlier than it arrived: the modeled GPU waits for the host
        self._modeled = max(self._modeled, time.perf_counter_ns())
        super().run(batch)

    def received(self, start: int, seq: int, nbytes: int, count: int) -> None:
        self._modeled = max(self._modeled, start)
        super().received(self._modeled, seq, nbytes, count)  # at once: nothing travels

    def _execute(self, batch: list[tuple]) -> None:
        if self._made.active:  # a replayed program, run by an instruction of the batch
            self._timed(batch)
            return
        self._made.active = True
        try:
            with self._made:
                self._timed(batch)
        finally:
            self._made.active = False

    def _timed(self, batch: list[tuple]) -> None:
        """Each instruction run, then the clock moved on by its modeled time."""
        env, groups = self.env, self.plane.sizes
        for ins in batch:
            name, out, args, tmask, kw = ins
            inputs = [t for i, a in enumerate(args) if tmask >> i & 1
                      for t in costmodel.tensors(env.get(a))]
            super()._execute((ins,))
            op = OPS.get(name)
            if op is None:
                continue
            if op.kind is Kind.MATMUL and not self._workspaces:
                self._workspace(1)
            made = [t for o in ((out,) if type(out) is int else out or ())
                    for t in costmodel.tensors(env.get(o))]
            self._modeled += costmodel.instruction_ns(name, op.kind, inputs, made, self.gpu,
                                                      costmodel.members_of(kw, groups))


_ABSENT = object()


class _Value:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _left(env: dict, new: int) -> Any:
    """What a metered replay left under ``new``, for later replays to leave alike: a tensor's
    (shape, strides, dtype), any other value as it is (the None that stands for a fused op's
    record of attention on meta, which its gradient reads), or _ABSENT."""
    value = env.get(new, _ABSENT)
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.dtype)
    return value if value is _ABSENT else _Value(value)


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

    def __init__(self, workers: int = 1) -> None:
        self.stats: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # kind -> [count, bytes]
        self.started = False
        self.sizes: dict[int, int] = {0: workers}  # group -> members, for the cost model
        self._sends: list[torch.Tensor] = []  # while holding: the snapshots of the sends
        self.holding = False  # in a program a GPU captures: every send's until its end

    @property
    def workers(self) -> int:
        return self.sizes[0]

    def init(self, backend: str) -> None:
        self.started = True

    def new_group(self, gid: int, ranks: tuple[int, ...]) -> None:
        self.sizes[gid] = len(ranks)

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
        return views_of(flat, [x.shape for x in xs])

    def take_work(self) -> Any:
        return None

    def all_gather(self, x: torch.Tensor, group: int, dim: int, sizes: tuple[int, ...],
                   ahead: bool = False) -> torch.Tensor:
        shape = list(x.shape)
        self._count("all_gather", x.new_empty([*shape[:dim], max(sizes), *shape[dim + 1:]]))
        shape[dim] = sum(sizes)
        return x.new_empty(shape)

    def all_gather_many(self, xs: tuple[torch.Tensor, ...], group: int,
                        members: int) -> tuple[torch.Tensor, ...]:
        for x in xs:
            self._count("all_gather", x)
        return tuple(x.new_empty((members * x.shape[0], *x.shape[1:])) for x in xs)

    def gather_pieces(self, xs: tuple, group: int,
                      sizes: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, ...]:
        k = len(xs) // 2
        _, top, _ = bucket_rows(xs[:k], sizes, 0)
        self._count("all_gather", xs[0].new_empty(top))
        return xs[:k]

    def reduce_scatter_bucket(self, xs: tuple[torch.Tensor, ...], group: int,
                              sizes: tuple[tuple[int, ...], ...], index: int) -> tuple:
        counts, top, mine = bucket_rows(xs, sizes, index)
        self._count("reduce_scatter", xs[0].new_empty(top * len(counts)))
        return views_of(xs[0].new_empty(top), mine)  # pieces of their own, as NCCL's

    def reduce_scatter(self, x: torch.Tensor, group: int, dim: int, sizes: tuple[int, ...],
                       index: int) -> torch.Tensor:
        self._count("reduce_scatter", x)
        # a piece of its own, as NCCL's: a view would keep the whole partial sum counted
        return x.narrow(dim, sum(sizes[:index]), sizes[index]).clone()

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
        """As the data plane's: a snapshot travels, held until the send is done: at once here
        (a GPU's sends finish within microseconds), but in a program being captured only at
        the capture's end (``holding``)."""
        x = x.clone(memory_format=torch.contiguous_format)
        if self.holding:
            self._sends.append(x)
        self._count("send", x)
        return ()

    def recv(self, shape: tuple, dtype: torch.dtype, src: int) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device="meta")
        self._count("recv", x)
        return x

    def held(self) -> dict[str, int]:
        return {"sends_in_flight": 0, "send_bytes_held": 0}

    def settle_sends(self) -> None:
        self._sends.clear()

    def begin_capture(self) -> None:
        pass

    def end_capture(self) -> None:
        pass

    def finish(self) -> None:
        pass
