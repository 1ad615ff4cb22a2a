"""The data plane on a worker: torch.distributed among the workers, directly (gloo on CPUs,
NCCL on GPUs); tensor bytes between workers never pass through rank 0.

It starts when the dispatcher first places a tensor on several workers (a 'dist_init' control
word reaches every worker at the same point of its stream); groups are created by
'new_group' words, which also reach every worker in one order, as torch requires. Collectives
and transfers are ops of the table (Kind.COMM); the dispatcher issues each to all members of
its group in one global order, so workers never wait on mismatched collectives.
"""
from __future__ import annotations

import math
import os
import socket
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ..ops.table import views_of
from ..transport.mpi import ClientGone
from ..transport.poll import wait_for
from .meeting import Meeting


# newer torch renamed these (its old names then warn with a FutureWarning on every call)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
SENDS_IN_FLIGHT = 8  # unfinished sends a worker keeps before it waits for the oldest


class DataPlane:
    COALESCES = True  # several collectives in one NCCL launch (torch's coalescing manager)

    def __init__(self, rank: int, device: torch.device, workers_comm: Any,
                 take_waiting: Callable[[], None] = lambda: None,
                 client: tuple[Meeting, int, Callable[[], str | None]] | None = None) -> None:
        """``client``: a server's client's plane (the workers' Meeting, its slot, and what
        says the server dropped it, or None), whose collectives are met first and run in
        groups of its own."""
        self.rank = rank
        self._client = client
        self.abandoned: list[Any] = []  # what a client dropped mid-wait left running
        self.device = device
        self.workers_comm = workers_comm  # an MPI communicator of the workers only
        self.groups: dict[int, Any] = {}
        # the same groups over MPI, with their members' ranks: agreements are host facts, and
        # settling them over NCCL would make every worker wait for its GPU's queue to drain
        self.comms: dict[int, tuple[MPI.Intracomm, tuple[int, ...]]] = {}
        self.backend = ""
        self.stats: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # kind -> [count, bytes]
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()  # (isend's work, its snapshot)
        self._works: list[Any] = []  # see take_work
        self._captured_sends: list | None = None  # while a CUDA graph is captured
        # transfers to a higher rank go through a group of their own: NCCL runs one
        # communicator's operations in order on one stream, so with both directions on one, a
        # pipeline stage's receive of a gradient would wait behind its send of the next
        # activation, which waits for the next stage to be done with the backward that sends
        # that gradient
        self._upward = None
        self._waiter: ThreadPoolExecutor | None = None  # see wait
        self._take_waiting = take_waiting  # what rank 0 sent, taken while gloo waits

    @property
    def started(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def workers(self) -> int:
        """The job's workers."""
        return self.workers_comm.Get_size()

    def init(self, backend: str) -> None:
        """Collective over every worker: the first one hosts the rendezvous store. A server's
        second client finds the process group made and makes only its own groups."""
        comm = self.workers_comm
        if self._client is not None:
            self._meet(("dist_init", backend), None)
        if self.started:
            self._own_groups(dist.get_backend())
            return
        first = comm.Get_rank() == 0
        one_host = len(set(comm.allgather(socket.gethostname()))) == 1
        if one_host:  # keep gloo on loopback: other interfaces may be down or firewalled
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        host = "127.0.0.1" if one_host else _host()
        store = None
        if first:
            store = dist.TCPStore(host, 0, comm.Get_size(), is_master=True,
                                  wait_for_workers=False)
            address = (host, store.port)
        address = comm.bcast(address if first else None, root=0)
        if not first:
            store = dist.TCPStore(address[0], address[1], comm.Get_size(), is_master=False)
        # sends and receives share the default group with collectives, in the one order the
        # dispatcher gives them all; NCCL warns about exactly that serialisation
        os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
        kw = {"device_id": self.device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=comm.Get_rank(),
                                world_size=comm.Get_size(), **kw)
        self._own_groups(backend)

    def _own_groups(self, backend: str) -> None:
        comm = self.workers_comm
        self.backend = backend
        everyone = tuple(range(1, comm.Get_size() + 1))
        if self._client is None:
            self.groups[0] = dist.group.WORLD
            self.comms[0] = (comm, everyone)
        else:  # a server's client: a collective of its left unmet leaves others' groups whole
            self.groups[0] = dist.new_group(list(range(comm.Get_size())))
            self.comms[0] = (comm.Dup(), everyone)
        self._upward = dist.new_group(list(range(comm.Get_size())))

    def _meet(self, what: tuple, group: int | None) -> None:
        """A server's client's collective, said and heard by every member of ``group`` (None:
        every worker) before any starts it (worker/meeting.py)."""
        meeting, slot, dropped = self._client
        members = self.comms[group][1] if group is not None else range(1, self.workers + 1)
        meeting.meet(slot, ("c", group), members, what, dropped)

    def new_group(self, gid: int, ranks: tuple[int, ...]) -> None:
        """Every worker calls this for every group, in the same order (torch requires it)."""
        if self._client is not None:
            self._meet(("new_group", gid, tuple(ranks)), None)
        self.groups[gid] = dist.new_group([r - 1 for r in ranks])
        sub = self.workers_comm.Split(0 if self.rank in ranks else MPI.UNDEFINED, self.rank)
        if sub != MPI.COMM_NULL:
            self.comms[gid] = (sub, tuple(sorted(ranks)))

    def wait(self, work: Any) -> None:
        """Until ``work`` (a collective or transfer this worker started) is done. gloo's wait
        blocks the thread, and a worker blocked without taking part in MPI stops rank 0: the
        batches rank 0 sent it and it has not received hold MPI's shared-memory cells, which
        rank 0's sends to every other worker then wait for, so the worker whose next batch
        has the receive this one waits for never gets it. So gloo is waited for on a thread
        of its own while this one takes what rank 0 sends (HostLink.take_waiting); NCCL's
        wait only orders the GPU's streams."""
        self.call(work.wait)

    def call(self, fn: Callable[[], Any]) -> Any:
        """fn() run to its end (a compiled program with collectives inside, worker/compiled.py)
        while this worker takes what rank 0 sends, as wait does for gloo's collectives."""
        if self.backend == "nccl":
            return fn()
        if self._waiter is None:
            self._waiter = ThreadPoolExecutor(1, thread_name_prefix="gloo-wait")
        done = self._waiter.submit(fn)
        self._until(done.done, done)
        return done.result()  # what fn returned, or raised

    # the collectives themselves, started (not waited for) in a member's group: their works
    def start_all_reduce(self, t: torch.Tensor, group: int, op: str = "sum") -> Any:
        """t reduced over the group (``op``: sum, max), in place."""
        return dist.all_reduce(t, getattr(dist.ReduceOp, op.upper()), group=self.groups[group],
                               async_op=True)

    def _gather(self, out: torch.Tensor, piece: torch.Tensor, group: int) -> Any:
        """Every member's piece into ``out``, members outermost."""
        return _ALL_GATHER(out, piece, group=self.groups[group], async_op=True)

    def _scatter(self, out: torch.Tensor, whole: torch.Tensor, group: int) -> Any:
        """``whole`` (members' parts outermost) summed over the group: this member's part."""
        return _REDUCE_SCATTER(out, whole, group=self.groups[group], async_op=True)

    def _laid(self, parts: tuple) -> torch.Tensor:
        return _flat(parts)

    def _until(self, test: Callable[[], bool], pending: Any) -> None:
        """Take what rank 0 sends until ``test()``; a server's client dropped meanwhile (its
        partner left the collective unmet) leaves ``pending`` to run into nothing."""
        take = self._take_waiting
        if self._client is None:
            wait_for(lambda: True if test() else take())
            return
        dropped = self._client[2]  # which takes what rank 0 sent, too

        def settled() -> bool | None:
            if test():
                return True
            why = dropped()
            if why is not None:
                self.abandoned.append(pending)
                raise ClientGone(why)
            return None
        wait_for(settled)

    def _count(self, kind: str, t: torch.Tensor) -> None:
        entry = self.stats[kind]
        entry[0] += 1
        entry[1] += t.numel() * t.element_size()

    # kernels ------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, group: int, inplace: bool = False) -> torch.Tensor:
        """P -> R: the sum of every member's piece, on every member (in x itself, or in a
        copy where x may still be seen as the piece it was)."""
        if self._client is not None:
            self._meet(("all_reduce", x.numel(), str(x.dtype)), group)
        y = x if inplace else x.clone()
        self.wait(self.start_all_reduce(y, group))
        self._count("all_reduce", y)
        return y

    def all_reduce_async(self, x: torch.Tensor, group: int) -> None:
        """P -> R in x itself, not waited for: take_work() gives what to wait on before x is
        read (a kernel's own reduction, overlapping what the kernel computes next)."""
        if self._client is not None:
            self._meet(("all_reduce", x.numel(), str(x.dtype)), group)
        self._works.append(self.start_all_reduce(x, group))
        self._count("all_reduce", x)

    def reduce_bucket(self, xs: tuple[torch.Tensor, ...], group: int) -> tuple[torch.Tensor, ...]:
        """P -> R for several tensors in one collective that is not waited for: the sums come
        back as views of one flat buffer, and take_work() gives what to wait on before any of
        them is read."""
        if self._client is not None:
            self._meet(("all_reduce", sum(x.numel() for x in xs), str(xs[0].dtype)), group)
        flat = torch.cat([x.reshape(-1) for x in xs])
        self._works.append(self.start_all_reduce(flat, group))
        self._count("all_reduce", flat)
        return views_of(flat, [x.shape for x in xs])

    def reduce_scatter_bucket(self, xs: tuple[torch.Tensor, ...], group: int,
                              sizes: tuple[tuple[int, ...], ...], index: int) -> tuple:
        """P -> S(0) for several tensors in one collective that is not waited for (as
        reduce_bucket): every member's rows of every tensor laid end to end, members
        outermost; this member's sums come back as views of one buffer. gloo has no
        reduce-scatter: there the buffer is all-reduced whole and this member's part copied."""
        if self._client is not None:
            self._meet(("reduce_scatter", sizes, str(xs[0].dtype)), group)
        counts, top, mine = bucket_rows(xs, sizes, index)
        parts = []
        for m, count in enumerate(counts):
            parts += [x.narrow(0, sum(n[:m]), n[m]).reshape(-1) for x, n in zip(xs, sizes)]
            if count < top:  # uneven rows: every member's part padded to the longest
                parts.append(xs[0].new_zeros(top - count))
        flat = torch.cat(parts)
        self._count("reduce_scatter", flat)
        if self.backend != "nccl":
            self.wait(self.start_all_reduce(flat, group))
            out = flat.narrow(0, index * top, counts[index]).clone()
        else:
            out = flat.new_empty(top)
            self._works.append(self._scatter(out, flat, group))
        return views_of(out, mine)

    def all_gather_many(self, xs: tuple[torch.Tensor, ...], group: int,
                        members: int) -> tuple[torch.Tensor, ...]:
        """Several tensors' pieces of one size along dim 0 gathered whole, not waited for
        (take_work() gives what to wait on): over NCCL one launch for them all (torch's
        coalescing manager, one NCCL group), each gathered straight into its whole."""
        if self._client is not None:
            self._meet(("all_gather_many", tuple(tuple(x.shape) for x in xs), str(xs[0].dtype)),
                       group)
        pieces = [x.contiguous() for x in xs]
        outs = [p.new_empty((members * p.shape[0], *p.shape[1:])) for p in pieces]
        if self.backend == "nccl" and self.COALESCES:
            with dist._coalescing_manager(group=self.groups[group], async_ops=True) as together:
                for out, piece in zip(outs, pieces):
                    _ALL_GATHER(out, piece, group=self.groups[group])
            self._works.append(together)
        else:
            for out, piece in zip(outs, pieces):
                self.wait(self._gather(out, piece, group))
        for piece in pieces:
            self._count("all_gather", piece)
        return tuple(outs)

    def take_work(self) -> Any:
        """The unfinished collectives the last kernel started, to wait on as one (None if it
        started none)."""
        works, self._works = self._works, []
        return _Works(self, works) if works else None

    def all_gather(self, x: torch.Tensor, group: int, dim: int, sizes: tuple[int, ...],
                   ahead: bool = False) -> torch.Tensor:
        """S(dim) -> R: the pieces concatenated along dim; uneven pieces travel padded.
        ``ahead`` (pieces of one size along dim 0): not waited for; take_work() gives what to
        wait on before the result is read."""
        if self._client is not None:
            self._meet(("all_gather", dim, sizes, x.shape[:dim] + x.shape[dim + 1:], str(x.dtype)),
                       group)
        piece = _pad(x.contiguous(), dim, max(sizes))
        # into one buffer, members outermost: no copy out of a list of parts, and pieces of
        # one size along dim 0 are the whole already (a view); along another dim, one copy
        flat = piece.new_empty((len(sizes) * piece.shape[0], *piece.shape[1:]))
        work = self._gather(flat, piece, group)
        self._count("all_gather", piece)
        if ahead and dim == 0 and len(set(sizes)) == 1:
            self._works.append(work)
            return flat
        self.wait(work)
        out = flat.view(len(sizes), *piece.shape)
        if len(set(sizes)) == 1:
            return out.movedim(0, dim).flatten(dim, dim + 1)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(out.unbind(0), sizes)], dim)

    def gather_pieces(self, xs: tuple, group: int,
                      sizes: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, ...]:
        """ZeRO's gather: ``xs`` is k whole tensors then this member's k pieces along dim 0
        (``sizes[i]``: tensor i's rows per member); every member's pieces are written into
        the whole tensors, through one all-gather of each member's pieces laid end to end
        (FSDP2's flat buffer: one collective where one per tensor cost a host round each)."""
        k = len(xs) // 2
        wholes, pieces = xs[:k], xs[k:]
        if self._client is not None:
            self._meet(("gather_pieces", sizes, str(wholes[0].dtype)), group)
        rows = [w[0].numel() for w in wholes]  # elements per row
        members = len(sizes[0])
        counts, top, _ = bucket_rows(wholes, sizes, 0)
        flat = _pad(self._laid(pieces), 0, top)
        out = flat.new_empty(members * top)
        self.wait(self._gather(out, flat, group))
        self._count("all_gather", flat)
        starts = [[sum(n[:m]) for m in range(members)] for n in sizes]
        dst, src = [], []
        for m in range(members):
            parts = out.narrow(0, m * top, counts[m]).split(
                [n[m] * r for n, r in zip(sizes, rows)])
            for i, part in enumerate(parts):
                if sizes[i][m]:
                    target = wholes[i].narrow(0, starts[i][m], sizes[i][m])
                    dst.append(target)
                    src.append(part.view(target.shape))
        torch._foreach_copy_(dst, src)
        return wholes

    def reduce_scatter(self, x: torch.Tensor, group: int, dim: int, sizes: tuple[int, ...],
                       index: int) -> torch.Tensor:
        """P -> S(dim): each member gets the sum of its piece only (half the bytes of an
        all-reduce); gloo has no reduce-scatter, so there it sums everything and cuts."""
        if self._client is not None:
            self._meet(("reduce_scatter", dim, sizes, tuple(x.shape), str(x.dtype)), group)
        if self.backend != "nccl":  # counted as what it stands for, as a dry run counts it
            whole = x.clone()
            self.wait(self.start_all_reduce(whole, group))
            self._count("reduce_scatter", x)
            # a copy: the piece, a view, would keep the whole sum alive (ZeRO-2's and -3's
            # gradients would cost what they save)
            return whole.narrow(dim, sum(sizes[:index]), sizes[index]).clone()
        longest = max(sizes)
        # members' pieces outermost in one buffer (along dim 0: x itself), uneven ones padded
        if len(set(sizes)) == 1:
            whole = x.unflatten(dim, (len(sizes), longest)).movedim(dim, 0).contiguous()
        else:
            whole = torch.stack([_pad(p, dim, longest) for p in torch.split(x, list(sizes), dim)])
        out = whole.new_empty(whole.shape[1:])
        self.wait(self._scatter(out, whole, group))
        self._count("reduce_scatter", x)
        return out if sizes[index] == longest else out.narrow(dim, 0, sizes[index]).clone()

    def all_to_all(self, x: torch.Tensor, group: int, src: int, dst: int,
                   src_sizes: tuple[int, ...], dst_sizes: tuple[int, ...], index: int) -> torch.Tensor:
        """S(src) -> S(dst): each member sends every other the part of its piece that the other
        keeps, and keeps what it gets, joined along src (the fewest bytes for a reshard)."""
        if self._client is not None:
            self._meet(("all_to_all", src, dst, src_sizes, dst_sizes, str(x.dtype)), group)
        # uneven pieces travel padded to one size (gloo insists on it)
        parts = [_pad(_pad(p.contiguous(), dst, max(dst_sizes)), src, max(src_sizes))
                 for p in torch.split(x, list(dst_sizes), dst)]
        outs = [torch.empty_like(parts[0]) for _ in src_sizes]
        self.wait(dist.all_to_all(outs, parts, group=self.groups[group], async_op=True))
        self._count("all_to_all", x)
        return torch.cat([o.narrow(src, 0, n).narrow(dst, 0, dst_sizes[index])
                          for o, n in zip(outs, src_sizes)], src)

    def agree(self, fault: Any, group: int) -> Any:
        """Collective: the Fault of the member of highest rank that has one (None if none
        has), on every member, so that all of them skip what one of them cannot compute.
        Faults are known on the host when an op is issued, so the members agree over MPI
        without waiting for their GPUs."""
        if self._client is not None:
            self._meet(("agree",), group)
        comm, ranks = self.comms[group]
        mine = np.array([fault.rank if fault is not None else 0], dtype=np.int32)
        worst = np.zeros(1, dtype=np.int32)
        request = comm.Iallreduce(mine, worst, op=MPI.MAX)
        self._until(request.Test, (request, mine, worst))
        self._count("agree", torch.from_numpy(mine))
        if not worst[0]:
            return None
        return comm.bcast(fault, root=ranks.index(int(worst[0])))

    def send(self, x: torch.Tensor, dst: int) -> tuple:
        """Without waiting: the receiver takes it when its stream gets there. No results. A
        snapshot travels: later ops of this stream may change x in place before it has left."""
        if self._client is not None:  # its receiver waits for this word (a sender waits for none)
            meeting, slot, _ = self._client
            meeting.say(slot, ("t", self.rank, dst), (dst,), ("send", tuple(x.shape), str(x.dtype)))
        x = x.clone(memory_format=torch.contiguous_format)
        group = self._upward if dst > self.rank else None
        if self._captured_sends is not None:  # no event may be queried while capturing
            self._captured_sends.append((dist.isend(x, dst - 1, group=group), x))
            self._count("send", x)
            return ()
        sends = self._sends
        sends.append((dist.isend(x, dst - 1, group=group), x))
        self._count("send", x)
        # gloo's work says it is completed only once waited for, so older sends are waited
        # for (a receiver gets there without this worker, given the batches rank 0 holds for
        # it: see wait); NCCL's wait only orders the streams
        while len(sends) > SENDS_IN_FLIGHT or (sends and sends[0][0].is_completed()):
            self.wait(sends.popleft()[0])
        return ()

    def held(self) -> dict[str, int]:
        """What the data plane itself holds: snapshots of sends not yet known to have left."""
        return {"sends_in_flight": len(self._sends),
                "send_bytes_held": sum(t.numel() * t.element_size() for _, t in self._sends)}

    def recv(self, shape: tuple, dtype: torch.dtype, src: int) -> torch.Tensor:
        if self._client is not None:  # the sender's word first: a send it never made waits
            meeting, slot, dropped = self._client  # in the meeting, not in torch
            meeting.expect(slot, ("t", src, self.rank), src, ("send", tuple(shape), str(dtype)),
                           dropped)
        x = torch.empty(shape, dtype=dtype, device=self.device)
        self.wait(dist.irecv(x, src - 1, group=self._upward if src < self.rank else None))
        self._count("recv", x)
        return x

    def settle_sends(self) -> None:
        """Wait for every send still held, and drop its snapshot: at a sync, which every worker
        reaches after the receives matching this worker's sends, so none waits on this one."""
        while self._sends:
            self.wait(self._sends.popleft()[0])

    def begin_capture(self) -> None:
        """Sends from here on are part of a CUDA graph being captured."""
        self.settle_sends()
        self._captured_sends = []

    def end_capture(self) -> None:
        """Join the captured sends back into the capturing stream (a capture must end with
        every stream it forked joined); their snapshots live in the graph's memory."""
        sends, self._captured_sends = self._captured_sends or [], None
        for work, _ in sends:
            self.wait(work)

    def finish(self, everything: bool = True) -> None:
        """Free this plane's groups and, with ``everything``, the process group (a server keeps
        it for its other clients when one leaves). A client dropped while this plane waited
        for its partners leaves its groups as they are: something still runs in them."""
        try:
            self.settle_sends()
        except ClientGone:  # a send its receiver was never sent: abandoned
            pass
        if self.abandoned:
            if self._waiter is not None:
                self._waiter.shutdown(wait=False)
            return
        if self._waiter is not None:
            self._waiter.shutdown()
            self._waiter = None
        for comm, _ in self.comms.values():
            if comm is not self.workers_comm:
                comm.Free()
        self.comms.clear()
        if not self.started:
            return
        if everything:
            dist.destroy_process_group()
            return
        for group in [*self.groups.values(), self._upward]:
            if group is not None and group is not dist.group.WORLD:
                dist.destroy_process_group(group)
        self.groups.clear()
        self._upward = None


class TracedPlane(DataPlane):
    """A worker's data plane as a compiled program's trace sees it (worker/compiled.py): the
    same kernels over the same groups, each collective torch's functional one (an aten op
    that make_fx records and Inductor compiles) waited for at once, its result copied where
    the eager kernel's lands. What it counts is what one run of the program moves."""
    COALESCES = False  # one functional collective per tensor (Inductor may bucket them)

    def __init__(self, plane: DataPlane) -> None:
        if plane._client is not None:
            raise RuntimeError("a server's client's collectives meet first, which a compiled "
                               "program cannot")
        self.rank, self.device, self.backend = plane.rank, plane.device, plane.backend
        self.groups, self.comms, self._client = plane.groups, plane.comms, None
        self.stats = defaultdict(lambda: [0, 0])
        self._works = []

    def _laid(self, parts: tuple) -> torch.Tensor:  # a trace's tensors have no addresses
        return torch.cat([p.reshape(-1) for p in parts])

    def wait(self, work: Any) -> None:
        pass  # each collective was waited for where it started

    def start_all_reduce(self, t: torch.Tensor, group: int, op: str = "sum") -> None:
        t.copy_(_FUNCTIONAL.wait_tensor(_FUNCTIONAL.all_reduce(
            t, op, self.groups[group].group_name)))

    def _gather(self, out: torch.Tensor, piece: torch.Tensor, group: int) -> None:
        g = self.groups[group]
        out.copy_(_FUNCTIONAL.wait_tensor(_FUNCTIONAL.all_gather_into_tensor(
            piece, g.size(), g.group_name)).view(out.shape))

    def _scatter(self, out: torch.Tensor, whole: torch.Tensor, group: int) -> None:
        g = self.groups[group]
        out.copy_(_FUNCTIONAL.wait_tensor(_FUNCTIONAL.reduce_scatter_tensor(
            whole, "sum", g.size(), g.group_name)).view(out.shape))


_FUNCTIONAL = torch.ops._c10d_functional  # torch.distributed's collectives as aten ops


class _Works:
    """The collectives one kernel started (its pieces' all-reduces): waited for together."""

    def __init__(self, plane: DataPlane, works: list[Any]) -> None:
        self.plane = plane
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            self.plane.wait(work)


def bucket_rows(xs: tuple, sizes: tuple[tuple[int, ...], ...], index: int) -> tuple:
    """A bucket of tensors cut along dim 0 (``sizes[i]``: tensor i's rows per member): the
    elements of each member's rows of them all, the longest of those, and the shapes of
    member ``index``'s pieces."""
    rows = [math.prod(x.shape[1:]) for x in xs]
    counts = [sum(n[m] * r for n, r in zip(sizes, rows)) for m in range(len(sizes[0]))]
    mine = [(n[index], *x.shape[1:]) for x, n in zip(xs, sizes)]
    return counts, max(counts), mine


def _flat(parts: tuple) -> torch.Tensor:
    """``parts`` laid end to end in one 1-D tensor: the buffer they are views of where they
    lie so already (ops/table.py: _pieces), else a copy."""
    first = parts[0]
    storage, at = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.dtype != first.dtype or p.storage_offset() != at \
                or p.untyped_storage().data_ptr() != storage:
            return torch.cat([p.reshape(-1) for p in parts])
        at += p.numel()
    return first.as_strided((at - first.storage_offset(),), (1,), first.storage_offset())


def _pad(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """x made ``length`` long along dim with zeros (collectives want pieces of one size)."""
    if x.shape[dim] == length:
        return x
    pad = list(x.shape)
    pad[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(pad)], dim)


def _host() -> str:
    """Where the other workers reach this one: GTMPI_MASTER_ADDR, else the host name."""
    return os.environ.get("GTMPI_MASTER_ADDR") or socket.gethostname()
