"""Turns the client's instruction stream into batches for workers.

Where each tensor lives is decided here. Until a signal places a tensor elsewhere, every
tensor lives on the home worker (the first one), as a one-device program expects, and no
instruction pays for placement; afterwards every instruction goes through the placer
(dispatcher/placer.py).

Batching is the whole cost model: one MPI message carries up to BATCH_MAX instructions.
A batch is sent early while its worker is idle (latency: a GPU must never wait for the
client) and held back while the worker is busy (throughput: fewer, larger messages). A lone
cheap op waits for one more instruction even then: it usually comes at once (often the read
that wants its result), and sharing one message saves the worker a whole receive cycle.
Workers acknowledge executed batches; at most MAX_INFLIGHT batches are unacknowledged per
worker, so a client that runs ahead of its workers blocks instead of growing memory.

Under a server (gtmpi/server), whose workers run other clients' work between this one's, what
is sent goes in rounds (end_round): the server hands a round to the workers whole, and a round
ends only where every transfer and collective in it has all its parts, so no worker can wait
in one for a part that another client's work holds up.

A transfer's receive is deferred: its send goes into the sender's stream when the transfer is
asked for, its receive into the receiver's stream only before the first instruction there
that uses what it brings (or before rank 0 waits for anything). On a GPU a receive holds its
stream until the bytes arrive, so a receive placed where the transfer was asked for would stop
the receiver in work that does not need it: a pipeline stage would wait for the next
micro-batch's activations before the backward it could run meanwhile.
"""
from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np
import torch

from ..transport.buffers import as_bytes, upload_pieces
from ..errors import Fault, ReplayError
from ..recording.events import Flag, Kind, Lane
from ..transport.poll import wait_for
from ..transport.tags import GRAPH_LATER, Tag
from ..ops.table import STEP_OPS
from .foresight import DONE, FREE, READY
from .programs import Graphing, Program, Recording
from .repeats import Repeats

_clock = time.perf_counter_ns

BATCH_MAX = 256
# under a server: a batch is the unit the workers run one client's work in before another's
# turn, so a smaller one bounds what another client's read waits behind
SHARED_BATCH_MAX = 8
MAX_INFLIGHT = 64
FREES_AHEAD = 64  # dropped ids that travel before the next instruction even if it is small
ACK_POLL_S = 5e-5  # how often a busy worker's acks are polled while ops are issued
GRAPH_AFTER = 1  # plain replays of a program before its workers capture it (a warm one)
CAPTURES_MAX = 4  # captures of a program its workers put off (transport.tags.GRAPH_LATER)
REFUSALS_KEPT = 256  # repeated runs' failed captures remembered by their ops (_refused_ops)
# sizes of one growing program captured as graphs (each holds its outputs for good); a size
# past them runs op by op
SIZES_MAX = 1024


class Link(Protocol):
    """Rank 0's end of a worker link (transport.mpi.WorkerLink or transport.local.LocalLink)."""

    def send(self, batch: list, seq: int) -> None: ...
    def upload(self, data: np.ndarray) -> None: ...
    def start_read(self, buf: np.ndarray) -> Any: ...
    def finish_read(self, handle: Any, watchdog: Callable[[], None]) -> Fault | None: ...
    def poll_ack(self) -> int | None: ...
    def moving(self) -> bool: ...
    def wait_reply(self, tag: Tag, watchdog: Callable[[], None] | None = None) -> Any: ...
    def poll_reply(self, tag: Tag) -> Any: ...
    def measure_clock(self, rounds: int) -> tuple[int, int, int]: ...
    def shutdown(self) -> None: ...
    def wait_bye(self, deadline: float) -> bool: ...


class Rounds(Protocol):
    """A server connection's side of rounds (transport/remote.py)."""

    pending: bool  # something was sent since the last round ended

    def end(self) -> None: ...


class Dispatcher:
    def __init__(self, links: dict[int, Link], watchdog: Callable[[], None]):
        self.links = links
        self.watchdog = watchdog
        self.home = min(links)
        self._batch: dict[int, list] = {r: [] for r in links}
        self._frees_in = dict.fromkeys(links, 0)  # free instructions among each batch's
        self._seq = dict.fromkeys(links, 0)
        self._acked = dict.fromkeys(links, 0)
        self._last_poll = 0.0
        # Tensor.__del__ appends here; frees travel before the next large instruction (or at
        # the end of the next batch sent), after every instruction that could still use them.
        self.frees: list[int] = []
        self._deferred: dict[int, list[tuple]] = {}  # rank -> receives not yet in its stream
        self._deferred_ids: dict[int, set[int]] = {}  # rank -> what those receives make
        self._unflushed: set[int] = set()  # ranks given a deferred receive since their flush
        self.trace = None  # a trace.Recorder while tracing: this rank's client and dispatcher lanes
        self.log = None  # a trace.InstructionLog: GT's text log of the instruction stream
        self.trace_tick: Callable[[], None] | None = None  # called after each traced send
        self.devices: dict[int, str] = {}  # rank -> its device, as the worker said
        self.recording: Recording | None = None  # while a replayable call is recorded
        self.in_replayable = 0  # replayable calls running now (client/replay.py)
        self.watched: dict[int, list[Program]] = {}  # id -> programs that read it
        self._before: dict | None = None  # the placer's table when the recording started
        self._inserted_before: dict = {}  # and its count of inserted collectives
        self._programs = 0
        self.graph_notes: dict[str, str] = {}  # program name -> its graph's fate, for explain()
        # why a repeated run's capture failed, by its ops' names: a run of the same ops at
        # other sizes (a decoding loop's sampling, a token longer each time) is not captured
        # again only to fail again, each failure a round trip to its workers
        self._refused_ops: dict[tuple, str] = {}
        self.rounds: Rounds | None = None  # under a server: its connection, which ends rounds
        self.batch_max = BATCH_MAX
        from .placer import Placer
        self.placer = Placer(self)
        # one worker's repeated runs of instructions are replayed (dispatcher/repeats.py) unless
        # GTMPI_AUTO_REPLAY=0
        self.repeats = Repeats(self) if os.environ.get("GTMPI_AUTO_REPLAY", "1") != "0" \
            else None
        # and, with GTMPI_AUTO_REPLAY_PLACED=1, the placed runs of every worker (off by default:
        # measured on GPUs for data parallelism only)
        self.placed_runs = os.environ.get("GTMPI_AUTO_REPLAY_PLACED") == "1"
        self._diverted = False  # the placer's instructions go into the held run

    def submit(self, ins: tuple, urgent: bool = True, issued: int = 0, sigs: list | None = None,
               outs: list | None = None, host: torch.Tensor | None = None,
               key: tuple | None = None) -> None:
        """A tensor instruction from the client, routed to the workers that hold its operands.
        ``urgent`` marks work big enough that an idle worker should start on it now; ``issued``
        is when the client started on it (traces only); ``sigs`` and ``outs`` are the
        (shape, dtype) of its operands and results, which placing needs; ``host`` is an upload's
        data; ``key``, the operands' signature_key where the client made it."""
        rec = self.trace
        if rec is not None:
            received = _clock()
        if self.frees and (urgent or len(self.frees) >= FREES_AHEAD):
            # ahead of a large result (or of many small ones), in stream order, so that their
            # memory serves what comes next; otherwise at the end of the batch, which costs
            # a tiny op no instruction of its own
            self._route_frees()
        if self.placer.active:  # logged once placed: only then is its worker known
            if self.repeats is not None and self.repeats.pending:
                self.repeats.close()
            if self._holding():
                rank = self.repeats.op(ins, urgent, key, sigs, outs, host)
                self._idle(self.home)
            else:
                rank = self.placer.submit(ins, sigs, outs, urgent, host, key)
            if self.log is not None:
                self.log.received(ins, rank)
        else:
            rank = self.home
            if self.log is not None:
                self.log.received(ins, rank)
            if self._holding():
                self.repeats.add(ins, urgent, key)
                # held instructions touch MPI only where a run goes out: poll now and then,
                # or an upload's bytes (a rendezvous, which moves only while this side calls
                # MPI) would keep the worker waiting for them
                self._idle(rank)
            else:
                self.enqueue(rank, ins, urgent)
        if self.rounds is not None:
            self.end_round()
        if rec is not None:
            rec.issues.append((issued or received, received, _clock(), ins[0], ins[1], rank))

    def gradient_ready(self, tid: int, sig: tuple) -> None:
        """Backward has made all of a leaf's gradient ``tid``: partial sums may be summed."""
        if self.placer.active:
            if self._holding():
                self.repeats.item(READY, (tid, sig))
            else:
                self.placer.reduce_soon(tid, sig)

    def backward_done(self) -> None:
        if self.placer.active:
            if self._holding():
                self.repeats.item(DONE, ())
            else:
                self.placer.reduce_now()

    def agree(self, ids: list[int]) -> None:
        """Every worker holding one of ``ids`` learns whether any replica or piece of it
        failed (Placer.agree_on), behind the instructions that made them: the run held so far
        goes first (a graph leaves agreements out: they talk to other workers' hosts)."""
        if self.placer.active:
            if self._holding():
                self.repeats.interrupt("agree")
            self.placer.agree_on(ids)

    @contextmanager
    def _diverting(self) -> Iterator[None]:
        """What the placer sends inside goes into the held run, where runs are held."""
        on = self._holding()
        self._diverted = on
        try:
            yield
        finally:
            self._diverted = False

    def enqueue(self, rank: int, ins: tuple, urgent: bool = True) -> None:
        """Into ``rank``'s next batch, which is sent early while the worker is idle."""
        if self._deferred and rank in self._deferred:
            waiting = self._deferred_ids[rank]
            if ins[0] == "alias" and ins[2][0] in waiting:
                # a name for what is still to be received (signal.tensor's copy): it waits too,
                # and so does the free of the name it replaces
                self._deferred[rank].append(ins)
                waiting.add(ins[1])
                return
            if ins[0] == "free" and waiting.issuperset(ins[2]):
                self._deferred[rank].append(ins)
                return
            if ins[0] == "agree":
                # a host barrier with the other members: a sender among them may be held by
                # sends this worker has yet to receive (a worker keeps few sends unfinished)
                self._undefer(rank)
            elif _reads(ins, waiting):
                pending = self._deferred[rank]
                self._undefer(rank, 1 + max(j for j, d in enumerate(pending)
                                            if d[0] != "free" and _reads(ins, {d[1]})))
        self._put(rank, ins, urgent)

    def _put(self, rank: int, ins: tuple, urgent: bool) -> None:
        if self._diverted:
            self.repeats.hold(rank, ins)
            if self.watched and ins[0] == "free":
                self._freeing(ins[2])
            return
        batch = self._batch[rank]
        batch.append(ins)
        if self.recording is not None:
            self.recording.add(rank, ins)
        if self.watched and ins[0] == "free":
            self._freeing(ins[2])
        # a lone cheap op waits for the next (often the read of it); frees riding along with
        # it do not count
        alone = len(batch) - self._frees_in[rank] <= 1
        if len(batch) >= self.batch_max or ((urgent or not alone) and self._idle(rank)):
            self.flush(rank)

    def _holding(self) -> bool:
        """Whether the client's instructions go into repeated runs (dispatcher/repeats.py):
        outside a replayable call's recording and a server's rounds, unplaced, or placed with
        GTMPI_AUTO_REPLAY_PLACED=1."""
        return self.repeats is not None and self.recording is None and self.rounds is None \
            and (not self.placer.active or self.placed_runs)

    def auto_replay(self, on: bool) -> None:
        """Repeated runs replayed from now on (a fresh memory of them), or no longer: what is
        held goes out, and the workers forget the programs."""
        if self.repeats is not None:
            self.close_run()
            self.repeats.forget()
        self.repeats = Repeats(self) if on else None

    def close_run(self) -> None:
        """Before anything that is not an instruction of the client's goes to a worker: the
        run held so far goes first, with the frees the client owes."""
        if self.repeats is not None:
            if self.frees and self._holding():
                self._route_frees()
            self.repeats.close()

    def defer(self, rank: int, ins: tuple) -> None:
        """A receive, into ``rank``'s stream before the first instruction that reads it."""
        self._deferred.setdefault(rank, []).append(ins)
        self._deferred_ids.setdefault(rank, set()).add(ins[1])

    def _undefer(self, rank: int, count: int | None = None) -> None:
        """The first ``count`` instructions deferred on ``rank`` (all by default), in the order
        asked: NCCL pairs a sender's sends with a receiver's receives in order."""
        pending = self._deferred.pop(rank)
        del self._deferred_ids[rank]
        rest = pending[len(pending) if count is None else count:]
        if rest:
            self._deferred[rank] = rest
            self._deferred_ids[rank] = {ins[1] for ins in rest if ins[0] != "free"}
        for ins in pending[:len(pending) - len(rest)]:
            self.enqueue(rank, ins, True)
        self._unflushed.add(rank)

    def settle_transfers(self) -> None:
        """Before rank 0 waits for anything: every deferred receive sent to its worker (a
        sender may be waiting for it)."""
        while self._deferred:
            self._undefer(next(iter(self._deferred)))
        while self._unflushed:
            self.flush(self._unflushed.pop())

    def upload(self, ins: tuple, host: torch.Tensor) -> None:
        """A contiguous CPU tensor, to the workers the 'upload' instruction ``ins`` makes it on:
        the home worker, or each member of a signal's placement its own piece, straight from
        here (a worker never forwards another's bytes)."""
        if self.placer.active:
            self.submit(ins, host=host)
            return
        self.send_bytes(self.home, ins[1], host)
        self.submit(ins)

    def send_bytes(self, rank: int, tid: int, host: torch.Tensor) -> None:
        """Host bytes for the next 'upload' instruction ``rank`` executes."""
        if self.recording is not None:
            raise ReplayError("a replayable function uploaded host data (a tensor made from "
                              "numpy, torch or Python values): its replays would use these "
                              "values again. Make the tensor before the call and pass it in")
        data = as_bytes(host.contiguous())
        link = self.links[rank]
        for a, b in upload_pieces(data.nbytes):
            link.upload(data[a:b])
        if self.trace is not None:
            t = _clock()
            self.trace.event(Kind.TRANSFER, Lane.DISPATCHER, t, t, "upload", tid, rank,
                             data.nbytes)

    def read(self, tensor_id: int, buf: np.ndarray, sig: tuple | None = None) -> Fault | None:
        """Fill ``buf`` with the raw bytes of a tensor (of ``sig``: shape, dtype), or return
        why it could not be made."""
        if self.recording is not None:
            raise ReplayError("a replayable function read a tensor's value (item(), numpy(), "
                              "print, bool, ...): its replays would not. Read its results "
                              "after the call instead")
        start = _clock()
        self.close_run()
        rank, rid = self.placer.read_source(tensor_id, sig) if self.placer.active else \
            (self.home, tensor_id)
        self.settle_transfers()
        link = self.links[rank]
        handle = link.start_read(buf)
        self._batch[rank].append(("read", None, (rid,), 0, None))
        if self.log is not None:
            self.log.received(self._batch[rank][-1], rank)
        if self.placer.active:
            self.placer.release()
        self.flush(rank)
        self.end_round()
        fault = link.finish_read(handle, self.watchdog)
        if self.trace is not None:
            self.trace.event(Kind.WAIT, Lane.CLIENT, start, _clock(), "read", tensor_id,
                             rank, buf.nbytes)
        return fault

    def ask_all(self, word: str, tag: Tag, args: tuple = (),
                ranks: list[int] | None = None) -> dict[int, Any]:
        """Send a control word to every worker (or ``ranks``), in stream order, and gather
        their replies."""
        start = _clock()
        ranks = list(self.links) if ranks is None else ranks
        self.post(word, args, ranks)
        replies = {rank: self.links[rank].wait_reply(tag, self.watchdog) for rank in ranks}
        if self.trace is not None:
            self.trace.event(Kind.WAIT, Lane.CLIENT, start, _clock(), word, count=len(ranks))
        return replies

    def post(self, word: str, args: tuple, ranks: list[int]) -> None:
        """A control word to each of ``ranks``, sent now, behind everything issued before."""
        self.close_run()
        self.settle_transfers()
        for rank in ranks:
            self._batch[rank].append((word, None, args, 0, None))
            self.flush(rank)
        self.end_round()

    def measure_clocks(self, ranks: list[int], rounds: int = 64) -> dict[int, tuple[int, int, int]]:
        """Per worker: (its clock minus ours, the round trip it was measured with, our time
        at the measurement), each from the fastest of ``rounds`` ping-pongs."""
        self.post("clock", (rounds,), ranks)
        return {rank: self.links[rank].measure_clock(rounds) for rank in ranks}

    def flush(self, rank: int) -> None:
        batch = self._batch[rank]
        rec = self.trace
        if self.frees and (rank == self.home or self.placer.active) and not self._holding():
            # held runs take frees only where the client's stream puts them, never where a
            # worker's pace does: a run's frees are part of what makes it repeat
            self._route_frees()
        if not batch:
            return
        self._batch[rank] = []
        self._frees_in[rank] = 0
        self._unflushed.discard(rank)
        if self.rounds is None and self._seq[rank] - self._acked[rank] >= MAX_INFLIGHT:
            if self._deferred or self._unflushed:
                # the worker may be waiting for a receive not yet sent: send those first (this
                # batch may go with them)
                self._batch[rank] = batch
                self.settle_transfers()
                batch, self._batch[rank] = self._batch[rank], []
                if not batch:
                    return
            start = _clock()
            wait_for(lambda: True if self._poll(rank) < MAX_INFLIGHT else None, self.watchdog,
                     self.links[rank].moving)
            if rec is not None:
                rec.event(Kind.WAIT, Lane.DISPATCHER, start, _clock(), "backpressure", peer=rank)
        self._seq[rank] += 1
        if rec is None:
            self.links[rank].send(batch, self._seq[rank])
        else:
            start = _clock()
            self.links[rank].send(batch, self._seq[rank])
            rec.event(Kind.SEND, Lane.DISPATCHER, start, _clock(), "batch", self._seq[rank], rank,
                      count=len(batch))
            rec.compact()
            if self.trace_tick is not None:
                self.trace_tick()
        if self.log is not None:
            self.log.sent(batch, rank, self._seq[rank])

    def _route_frees(self) -> None:
        """The ids the client dropped, into the batches of the workers that hold them, behind
        every instruction that could still use them."""
        frees, self.frees = self.frees, []
        if self.watched:
            self._freeing(frees)
        holding = self._holding()
        if holding and not self.placer.active:
            self.repeats.add(("free", None, tuple(frees), 0, None), False)
            return
        if holding:
            self.repeats.item(FREE, tuple(frees))
            return
        by_rank = self.placer.free(frees) if self.placer.active else {self.home: frees}
        for r, ids in by_rank.items():
            if r in self._deferred and not self._deferred_ids[r].isdisjoint(ids):
                self._undefer(r)  # rare (a transfer dropped unused): all of them
            self._batch[r].append(("free", None, tuple(ids), 0, None))
            if self.recording is not None:
                self.recording.add(r, self._batch[r][-1])
            self._frees_in[r] += 1
            if self.trace is not None:
                t = _clock()
                self.trace.event(Kind.FREE, Lane.DISPATCHER, t, t, "free", peer=r, count=len(ids))
            if self.log is not None:
                self.log.received(self._batch[r][-1], r)

    # recorded programs ---------------------------------------------------------------------

    def start_recording(self, first_id: int) -> None:
        """From now on, what is sent is also recorded (client ids from ``first_id`` on are made
        inside); frees the client owes are sent first, so that none of them is."""
        self.close_run()
        if self.frees:
            self._route_frees()
        self.settle_transfers()  # a receive asked for before is not the program's
        self.recording = Recording(first_id, self.placer.new_temp())
        self._before = dict(self.placer.table)
        self._inserted_before = {k: tuple(v) for k, v in self.placer.inserted.items()}

    def abandon_recording(self) -> None:
        self.recording = self._before = None

    def install(self, outputs: list[int], inputs: list[int], name: str = "replayable",
                sized: Callable[[list[tuple]], list[tuple]] | None = None,
                knobbed: bool = False) -> tuple[Program, list[int]]:
        """End the recording: the program goes to its workers, keyed there by a number of its
        own. ``outputs`` are the ids made inside that outlive the call, ``inputs`` those from
        outside that each call binds; ``name`` says which function it is, in notes. ``sized``:
        a worker's recorded instructions made ones whose sizes follow a growing argument
        (ops/table.py: Dim), each replay given its size, and each size its own CUDA graph.
        ``knobbed``: its instructions hold Knobs, which each replay gives: it runs op by op.
        Returns the
        program and the client ids it made that outlive it without being outputs (kept
        somewhere: it cannot be replayed)."""
        if self.frees:
            self._route_frees()
        self.settle_transfers()  # the program's receives are its own
        made, freed, read = self.recording.made_and_read()
        kept = made - freed - set(outputs)
        if kept:
            # what the call dropped in cycles is freed within it; a full collection costs
            # 0.2 s and more in a process holding torch and a model, so only when needed
            gc.collect()
            if self.frees:
                self._route_frees()
                self.settle_transfers()
                made, freed, read = self.recording.made_and_read()
                kept = made - freed - set(outputs)
        rec, self.recording = self.recording, None
        kept = sorted(kept)
        placer = self.placer
        reads = frozenset(read - set(inputs))
        before = tuple((tid, self._before.get(tid)) for tid in sorted(reads))
        changed = tuple((tid, now) for tid, entry in before
                        if (now := placer.table.get(tid)) is not entry)
        outs = tuple((tid, placer.table.get(tid), tid in placer.viewed) for tid in outputs)
        self._programs += 1
        program = Program(self._programs, name, tuple(sorted(rec.per_rank)), reads, before,
                          changed, outs, rec.random_ops)
        was = self._inserted_before
        program.inserted = {key: (n - was.get(key, (0, 0))[0], b - was.get(key, (0, 0))[1])
                            for key, (n, b) in placer.inserted.items()
                            if (n, b) != was.get(key, (0, 0))}
        self._before = None
        if sized is not None:
            # a graph per size is checked on CPUs (the stand-in backend) only so far:
            # GTMPI_SIZED_GRAPHS=1 turns it on, else the program runs op by op
            if os.environ.get("GTMPI_SIZED_GRAPHS", "0") == "1":
                program.sizes = {}
            else:
                program.graph = "its sizes follow its call's (a growing argument; " \
                    "GTMPI_SIZED_GRAPHS=1: a graph per size)"
        if knobbed:
            program.graph = "numbers in it change per call (an optimizer's rate)"
        if isinstance(program.graph, str):
            self.graph_notes[name] = f"replayed op by op, no CUDA graph: {program.graph}"
        program.marks = next((op for instructions in rec.per_rank.values()
                              for op, *_ in instructions if op in STEP_OPS), "replay")
        program.ops = tuple(op for instructions in rec.per_rank.values()
                            for op, *_ in instructions if op != "free")
        for rank, instructions in rec.per_rank.items():
            self.post("program", (program.key, instructions if sized is None
                                  else sized(instructions)), [rank])
        for tid in reads:
            self.watched.setdefault(tid, []).append(program)
        return program, kept

    def drop(self, program: Program) -> None:
        """A program no longer wanted: its workers forget it."""
        program.stale = True
        for tid in program.reads:
            watchers = self.watched.get(tid)
            if watchers and program in watchers:
                watchers.remove(program)
                if not watchers:
                    del self.watched[tid]
        self.post("program", (program.key, None), list(program.ranks))

    def fits(self, program: Program) -> bool:
        """Whether every tensor from outside is still there, placed as when it was recorded."""
        if self.frees and self.watched:  # dropped, not yet sent
            self._freeing(self.frees)
        if program.stale:
            return False
        table = self.placer.table
        if not table and not program.placed:  # nothing placed then or now (frees: stale)
            return True
        for tid, entry in program.before:
            now = table.get(tid)
            if now is not entry and now != entry:
                return False
        return True

    def replay(self, program: Program, binds: tuple, fresh: list[int],
               seeds: tuple[int, int] | None = None, size: int | None = None,
               knobs: tuple | None = None) -> None:
        """Run ``program`` again: ``binds`` are (current id, recorded id) of its inputs, its
        outputs take the ids ``fresh``, and its random ops derive their seeds from ``seeds``
        (the session seed, the count of random ops before the call); ``size``: its growing
        argument's (install's ``sized``); ``knobs``: its Knobs' values (install's
        ``knobbed``).

        After GRAPH_AFTER plain replays its workers capture it as a CUDA graph, all of them at
        the same point of their streams (a collective inside is captured by every member
        together, and nothing runs while it is captured): each says whether it could, and only
        if all could do they launch their graphs from then on; otherwise this call, and every
        later one, replays it instruction by instruction, and explain() says why."""
        received = _clock()
        self.close_run()
        if self.frees:
            self._route_frees()
        self.settle_transfers()
        renames = tuple((out[0], new) for out, new in zip(program.outputs, fresh))
        self.run_program(program, binds, renames, seeds, size, knobs)
        placer = self.placer
        for key, (count, nbytes) in program.inserted.items():  # what the replay runs again
            entry = placer.inserted.setdefault(key, [0, 0])
            entry[0] += count
            entry[1] += nbytes
        for tid, entry in program.changed:
            placer.table[tid] = entry
        for (_, entry, viewed), new in zip(program.outputs, fresh):
            if entry is not None:
                placer.table[new] = entry
            if viewed:
                placer.viewed.add(new)
        rec = self.trace
        if rec is not None:
            rec.issues.append((received, received, _clock(), program.marks, program.key,
                               program.ranks[0]))
            self.trace_inserted(program.inserted.items(), program.key)

    def trace_inserted(self, inserted: Iterable[tuple[tuple, tuple[int, int]]],
                       key: int) -> None:
        """The collectives a program runs that the client did not write, on the dispatcher's
        lane of the trace (count and bytes per (site, kind, asked)), as placing them would."""
        rec = self.trace
        if rec is None:
            return
        t = _clock()
        for (site, kind, asked), (count, nbytes) in inserted:
            rec.event(Kind.DISPATCH, Lane.DISPATCHER, t, t, kind, key, -1, nbytes, count=count,
                      flags=Flag.INSERTED, detail=f"{'asked' if asked else 'inserted'} {site}")

    def run_program(self, program: Program, binds: tuple | dict[int, tuple],
                    renames: tuple | dict[int, tuple], seeds: tuple[int, int] | None,
                    size: int | None = None, knobs: tuple | None = None) -> None:
        """The replay word for ``program`` to each of its workers (replay() says what it does;
        ``binds`` and ``renames`` may differ per worker), and, where it is captured now, the
        agreement on its graph."""
        state: Graphing | None = program
        if size is not None and program.sizes is not None:
            state = program.sizes.get(size)
            if state is None and len(program.sizes) < SIZES_MAX:
                state = program.sizes[size] = Graphing()
        mode = "plain"
        if state is None:  # a size past SIZES_MAX: op by op
            pass
        elif size is not None and program.sizes is None:  # one program for every size
            if program.dynamic is True:
                mode = "compiled"
            elif program.dynamic is None and state.replays >= GRAPH_AFTER and \
                    (compiling := compile_mode(program)):
                mode = f"compile:{compiling}"
        elif state.graph is True:
            mode = "graph"
        elif state.graph is None and state.replays >= GRAPH_AFTER:
            # GTMPI_CUDA_GRAPHS=0: never; emulate: the workers' stand-in (tests on CPUs);
            # otherwise each worker captures if it can
            graphs = os.environ.get("GTMPI_CUDA_GRAPHS", "1")
            mode = {"0": "plain", "emulate": "emulate"}.get(graphs, "capture")
            refused = program.auto and self._refused_ops.get(program.ops)
            if mode == "plain":
                self._graph_note(program, state, "GTMPI_CUDA_GRAPHS=0")
            elif refused:
                mode = "plain"
                self._graph_note(program, state, f"{refused} (a run of the same ops before)")
            elif (compiling := compile_mode(program)):
                mode = f"{mode}:{compiling}"
        if state is not None:
            state.replays += 1
        for rank in program.ranks:  # every member of its collectives gets it at once
            word = ("replay", None, (program.key, binds.get(rank, ()) if type(binds) is dict
                                     else binds, renames.get(rank, ()) if type(renames) is dict
                                     else renames, mode, seeds) +
                    (() if size is None and knobs is None else (size,)) +
                    (() if knobs is None else (knobs,)), 0, None)
            self._batch[rank].append(word)
            if self.log is not None:
                self.log.received(word, rank)
            self.flush(rank)
        self.end_round()
        if mode.startswith(("capture", "emulate")):
            self._commit(program, state)
        elif mode.startswith("compile:"):
            self._compiled_for_every_size(program)

    def _compiled_for_every_size(self, program: Program) -> None:
        """Whether every worker of a growing program compiled it for every size: then its
        replays run it so, else op by op (the notes say why)."""
        refused, how = self._graph_replies(program)
        program.dynamic = refused or True
        self.graph_notes[program.name] = \
            f"replayed op by op, no CUDA graph: {program.graph}; not compiled: {refused}" \
            if refused else f"replayed compiled, no CUDA graph: {program.graph} ({how})"

    def _commit(self, program: Program, state: Graphing) -> None:
        """Every worker of a program being captured says whether it could; all launch their
        graphs, or none does (a collective captured by some members only would never run)."""
        start = _clock()
        note, compiled = self._graph_replies(program)
        # straight behind the replay word: a free routed between them could take an input
        # the capture binds
        for rank in program.ranks:
            self._batch[rank].append(("commit", None, (program.key, not note), 0, None))
            self.flush(rank)
        self.end_round()
        self._graph_note(program, state, note or None, compiled)
        if self.trace is not None:
            self.trace.event(Kind.REPLAY, Lane.DISPATCHER, start, _clock(), "capture",
                             program.key, count=len(program.ranks),
                             detail=f"{program.name}: " + (f"no CUDA graph ({note})" if note
                                                           else "captured") +
                             (f"; {compiled}" if compiled else ""))

    def _graph_replies(self, program: Program) -> tuple[str, str]:
        """What each worker of a program being captured or compiled answered: why those that
        could not did not ('' if all could), and how its compiling went ('' if none did)."""
        replies = {rank: self.links[rank].wait_reply(Tag.GRAPH, self.watchdog)
                   for rank in program.ranks}
        refused = "; ".join(f"worker rank {rank}: {why}"
                            for rank, (why, _) in sorted(replies.items()) if why is not None)
        return refused, "; ".join(sorted({note for _, note in replies.values()
                                          if note is not None}))

    def _graph_note(self, program: Program, state: Graphing, refused: str | None,
                    compiled: str = "") -> None:
        state.captures += 1
        if refused is not None and refused.endswith(GRAPH_LATER) and state.captures < CAPTURES_MAX:
            return  # tried again at its next replay
        state.graph = True if refused is None else refused
        if refused is not None and program.auto and program.ops not in self._refused_ops:
            if len(self._refused_ops) >= REFUSALS_KEPT:
                self._refused_ops.clear()
            self._refused_ops[program.ops] = refused
        ranks = ", ".join(map(str, program.ranks))
        if program.sizes is None:
            self.graph_notes[program.name] = (f"a CUDA graph on worker(s) {ranks}" if
                                              refused is None else
                                              f"replayed op by op, no CUDA graph: {refused}") + \
                (f" ({compiled})" if compiled else "")
            return
        graphed = sum(s.graph is True for s in program.sizes.values())
        self.graph_notes[program.name] = (
            f"a CUDA graph per size ({graphed} of {len(program.sizes)} sizes) on worker(s) "
            f"{ranks}" + ("" if refused is None else f"; op by op at a size: {refused}"))

    def rename(self, pairs: list[tuple[int, int]]) -> None:
        """Tensors move to new ids, on every worker and in the placer's books."""
        for old, new in pairs:
            self.placer.rename(old, new)
        self.post("rename", tuple(pairs), sorted(self.links))

    def _freeing(self, ids) -> None:
        """Programs that read a tensor being freed are stale."""
        for tid in ids:
            for program in self.watched.pop(tid, ()):
                if program.auto and not program.stale:  # its graph holds what it read
                    self.repeats.stale.append(program)
                program.stale = True

    def flush_all(self) -> None:
        for rank in self.links:
            self.flush(rank)

    def end_round(self) -> None:
        """Under a server, once anything was sent since the last round: every deferred receive
        and every held batch sent too, then the round closed; a worker more than MAX_INFLIGHT
        batches behind is then waited for (never inside a round, which the server holds back
        until it is whole)."""
        rounds = self.rounds
        if rounds is None or not rounds.pending:
            return
        self.settle_transfers()
        for rank, batch in self._batch.items():
            if batch:
                self.flush(rank)
        rounds.end()
        for rank in self.links:
            if self._seq[rank] - self._acked[rank] >= MAX_INFLIGHT:
                wait_for(lambda: True if self._poll(rank) < MAX_INFLIGHT else None,
                         self.watchdog, self.links[rank].moving)

    def shutdown(self, timeout_s: float) -> list[int]:
        """Stop every worker; return the ranks that did not confirm within the timeout."""
        self.close_run()
        self.settle_transfers()
        self.flush_all()
        self.end_round()
        for link in self.links.values():
            link.shutdown()
        deadline = time.monotonic() + timeout_s
        missing = [rank for rank, link in self.links.items() if not link.wait_bye(deadline)]
        for link in self.links.values():
            link.poll_ack()  # acks sent before the goodbye: receive them, leave nothing unmatched
        return missing

    def _poll(self, rank: int) -> int:
        """Collect acks; return the number of batches still unacknowledged."""
        acked = self.links[rank].poll_ack()
        if acked is not None:
            self._acked[rank] = acked
        return self._seq[rank] - self._acked[rank]

    def _idle(self, rank: int) -> bool:
        if self._seq[rank] == self._acked[rank]:
            return True
        now = time.perf_counter()
        if now - self._last_poll < ACK_POLL_S:
            return False
        self._last_poll = now
        return self._poll(rank) == 0


def _reads(ins: tuple, ids: set[int]) -> bool:
    """Whether instruction ``ins`` uses any of ``ids`` (a free names them without a mask)."""
    name, _, args, tmask, _ = ins
    if name == "free":
        return not ids.isdisjoint(args)
    i = 0
    while tmask >> i:
        if tmask >> i & 1 and args[i] in ids:
            return True
        i += 1
    return False


# GTMPI_COMPILE unset: 'asked' is to take its place once a GPU has run it (until then it is
# GPU-unchecked: on only where set)
COMPILE_DEFAULT = "0"


def compile_setting() -> str:
    """GTMPI_COMPILE, or its default."""
    return os.environ.get("GTMPI_COMPILE", COMPILE_DEFAULT)


def compile_mode(program: Program) -> str:
    """What a capture of ``program`` asks its workers to compile with (GTMPI_COMPILE;
    worker/compiled.py): '' (0), 'inductor' (1), 'auto' (Inductor on GPU workers, where a
    compiled program wins, none on CPU workers) or 'fx' (the traced graph run as it is);
    'asked': what the program's maker asked, 'auto' for a module or function given to
    gtmpi.compile (torch.compile's place), '' for the rest."""
    value = compile_setting()
    if value == "asked":
        return program.compile
    modes = {"0": "", "1": "inductor", "inductor": "inductor", "auto": "auto", "fx": "fx"}
    if value not in modes:
        raise ValueError(f"GTMPI_COMPILE={value!r}: one of 0, 1, auto, asked, fx")
    return modes[value]
