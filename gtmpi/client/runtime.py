"""The in-process client's session: ids, issue sites, seeds, reads, and the dispatcher it feeds.

One session per process. It starts lazily at the first tensor op as the embedded default (one
worker in this process) unless gtmpi's launcher already made it an MPI session (rank 0 of an
mpiexec/srun job, or a plain process that called gtmpi.workers(n)).

A session serves one program thread: the first that issues an op or a read owns it, and any
other gets a clear error at its first call (the stream's order, the placement scopes and the
pending reads are the program's one sequence; interleaving threads would mix them). Once the
owner has ended, another thread may take over. Dropping a tensor is allowed from any thread
(the garbage collector runs where it likes).
"""
from __future__ import annotations

import functools
import itertools
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..dispatcher import Dispatcher
from ..signals.config import load
from .signalbook import SignalBook
from ..errors import NOT_USER, Fault, WorkerError, worker_error
from ..ops import settings
from ..ops.table import Seed, derive_seed
from ..transport import early, ending
from ..transport.ending import alive
from ..transport.rendezvous import LOOPBACK
from ..transport.tags import Tag

_normpath = functools.lru_cache(maxsize=1024)(os.path.normpath)  # "a/../../a/m.py" -> "a/m.py"
_SITES_PER_GENERATION = 1 << 16
NOTES_WAIT_S = 1.0  # for the death watchers' notes, which name the worker that went first


class Runtime:
    def __init__(self, links: dict[int, Any], workers: dict[int, dict],
                 abort: Callable[[str], None] | None = None):
        self.workers = workers  # rank -> what the worker said at start-up
        self._abort = abort
        self.dispatcher = Dispatcher(links, self._watchdog)
        self.dispatcher.devices = {rank: w["device"] for rank, w in workers.items()}
        self._ids = itertools.count(1)
        # Issue sites (file:line) by result id, for error messages; two generations bound it.
        self._sites: dict[int, tuple[str, int]] = {}
        self._old_sites: dict[int, tuple[str, int]] = {}
        self._internal_code: dict = {}  # code object -> is it gtmpi's own (skipped for sites)
        self.pinned_site: tuple[str, int] | None = None  # the site of all made now (sites_here)
        self._reported: dict[tuple, None] = {}  # origins of the Faults raised lately, in order
        self.faults_raised = 0  # WorkerErrors raised so far (autograd.zero_grads reads it)
        self.faults_at_zero_grad = 0
        self._seed = int.from_bytes(os.urandom(7), "little")
        self._random_ops = 0
        self.closed = False
        self.death_pending = False  # watch_idle saw a worker gone: the watchdog says which
        self.thread: threading.Thread | None = None  # the program thread it serves
        self.thread_id: int | None = None
        self.tracing = None  # a recording.session.TraceRun while a trace records
        self.monitor = None  # a monitor.hub.Hub while GTMPI_MONITOR is set
        self.autocast = None  # an amp.Region while gtmpi.autocast is on
        # selective activation checkpointing (utils/checkpoint.py): while a checkpointed
        # function runs, what keeps (first run) or hands back (recompute) the outputs of the
        # ops its policy saves
        self.selective = None
        # while a replayable call is recorded (client/replay.py): id(leaf) -> (leaf, the
        # gradient it had before backward gave it one)
        self.leaves: dict[int, tuple] | None = None
        self.module_calls = 0  # module calls running now (nn/capture.py captures the outermost)
        self.capture_notes: dict[str, Any] = {}  # per captured module: how its calls ran
        # gtmpi's own calls captured (client/replay.py: Repeated), by name, then call site
        self.repeated: dict[str, dict[str, Any]] = {}
        self.signals = SignalBook(self.dispatcher.placer, sorted(workers))
        self.dispatcher.placer.site = self.current_site
        self.dispatcher.placer.strict = os.environ.get("GTMPI_PLACEMENT", "") == "strict"
        self.dispatcher.placer.overlap = os.environ.get("GTMPI_OVERLAP", "1") != "0"
        self.dispatcher.placer.chunks = int(os.environ.get("GTMPI_OVERLAP_CHUNKS", "0"))
        self.dispatcher.placer.gather_ahead = os.environ.get("GTMPI_ZERO_AHEAD", "1") != "0"
        self.dispatcher.placer.scatter_buckets = os.environ.get("GTMPI_ZERO_BUCKETS", "1") != "0"
        self.dispatcher.placer.cast_gathers = os.environ.get("GTMPI_ZERO_CAST", "0") == "1"
        self.dispatcher.placer.coalesce_gathers = os.environ.get("GTMPI_ZERO_COALESCE", "0") == "1"

    @property
    def dry_run(self) -> str | None:
        """The simulated GPU's name in a dry run (client/dryrun.py), else None."""
        return next((w["dry_run"] for w in self.workers.values() if w.get("dry_run")), None)

    def begin(self) -> None:
        """What the environment asks of a session (a config, a log, a trace), once it is the
        current one: an error here (a malformed GTMPI_CONFIG) then ends the job as any of the
        program's errors does, the workers told to stop, status 1."""
        config = os.environ.get("GTMPI_CONFIG") or os.environ.get("GT_CONFIG")
        if config:
            self.signals.register(load(config))
        log = os.environ.get("GTMPI_INSTRUCTION_LOG") or os.environ.get("GT_INSTRUCTION_LOG")
        if log:
            from ..recording.instruction_log import InstructionLog
            self.dispatcher.log = InstructionLog(log)
        if os.environ.get("GTMPI_TRACE"):
            self.start_trace(os.environ["GTMPI_TRACE"])
        monitor = os.environ.get("GTMPI_MONITOR")
        if monitor and self.dispatcher.rounds is None:
            self.start_monitor(monitor)

    def start_monitor(self, port_file: str) -> None:
        """Workers push their figures to a hub on this rank; ``gtmpi-trace top port_file``
        shows them while the program runs."""
        from ..monitor.hub import Hub
        here = socket.gethostname()
        # workers on other hosts push over the network: every interface, unless told which
        bind = os.environ.get("GTMPI_MONITOR_BIND") or (
            LOOPBACK if all(w["host"] == here for w in self.workers.values()) else "0.0.0.0")
        self.monitor = Hub(port_file, "run", bind=bind, workers=len(self.workers),
                           ranks=sorted(self.workers))
        self.dispatcher.post("monitor", (self.monitor.address, self.monitor.token),
                             sorted(self.workers))

    # ids, sites, seeds ---------------------------------------------------------------------

    def new_id(self) -> int:
        return next(self._ids)

    def note_site(self, tensor_id: int) -> None:
        site = self.pinned_site
        if site is None:
            frame = self._user_frame(sys._getframe(2))
            if frame is None:
                return
            site = (frame.f_code.co_filename, frame.f_lineno)
        if len(self._sites) >= _SITES_PER_GENERATION:
            self._old_sites, self._sites = self._sites, {}
        self._sites[tensor_id] = site

    @contextmanager
    def sites_here(self) -> Iterator[None]:
        """Every tensor made inside gets the program's line running now as its site, found
        once (a backward pass: its hundreds of ops are that line's, and walking the stack out of
        the engine for each cost about a fifth of nanoGPT's client time)."""
        outer = self.pinned_site
        if outer is None:
            frame = self._user_frame(sys._getframe(2))
            self.pinned_site = (frame.f_code.co_filename, frame.f_lineno) if frame else None
        try:
            yield
        finally:
            self.pinned_site = outer

    def _user_frame(self, frame: Any) -> Any:
        """The innermost frame, from ``frame`` outwards, of the program rather than gtmpi."""
        internal = self._internal_code
        while frame is not None:
            code = frame.f_code
            inside = internal.get(code)
            if inside is None:
                # normalised: a program that put "<dir>/../.." on sys.path runs gtmpi's files
                # under such names
                # and Python's own wrappers (contextlib's, around clip_grad_norm_'s no_grad)
                # and the libraries installed beside it are not the program's lines either
                inside = internal[code] = os.path.abspath(code.co_filename).startswith(NOT_USER)
            if not inside:
                return frame
            frame = frame.f_back
        return None

    def current_site(self) -> str:
        """file:line of the program's line running now."""
        frame = self._user_frame(sys._getframe(1))
        return f"{_normpath(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None \
            else "?"

    def site(self, tensor_id: int) -> str | None:
        where = self._sites.get(tensor_id) or self._old_sites.get(tensor_id)
        return f"{_normpath(where[0])}:{where[1]}" if where else None

    def manual_seed(self, seed: int) -> None:
        self._seed = int(seed)
        self._random_ops = 0

    def rng_state(self) -> tuple[int, int]:
        """The workers' random stream: (session seed, random ops drawn so far)."""
        return self._seed, self._random_ops

    def set_rng_state(self, seed: int, drawn: int) -> None:
        self._seed, self._random_ops = int(seed), int(drawn)

    def next_seed(self) -> int:
        """Each random op gets its own seed, derived from the session seed and its position;
        inside a recorded call, a Seed that replays derive afresh (so a replayed step draws
        what it would draw as written)."""
        self._random_ops += 1
        seed = derive_seed(self._seed, self._random_ops)
        recording = self.dispatcher.recording
        if recording is None:
            # where repeated runs are replayed, the seed says its place in the session's
            # stream, so that a run of random ops can be replayed with the seeds of its own
            return seed if self.dispatcher.repeats is None else Seed(seed, self._random_ops)
        recording.random_ops += 1
        return Seed(seed, recording.random_ops)

    def draws(self) -> tuple[int, int | None]:
        """Where the random ops' seeds stand (the session's count, and the recording's):
        going back there draws the same numbers again (activation checkpointing's recompute
        draws its forward's dropout masks)."""
        recording = self.dispatcher.recording
        return self._random_ops, None if recording is None else recording.random_ops

    def draw_from(self, at: tuple[int, int | None]) -> None:
        self._random_ops = at[0]
        recording = self.dispatcher.recording
        if recording is not None and at[1] is not None:
            recording.random_ops = at[1]

    def seeds_for(self, random_ops: int) -> tuple[int, int] | None:
        """For a replay of a call that makes ``random_ops`` random ops: (the session seed, the
        count before the call), from which the workers derive each op's seed; the count moves
        on as if the call had run as written."""
        if not random_ops:
            return None
        base = self._random_ops
        self._random_ops += random_ops
        return self._seed, base

    def alike(self, ids: list[int], keys: list[Any]) -> list[list[int]]:
        """Positions of tensors that one multi-tensor instruction can take together: alike in
        ``keys`` and in where they live (each instruction runs on one placement)."""
        placer = self.dispatcher.placer
        groups: dict[Any, list[int]] = {}
        for i, (tid, key) in enumerate(zip(ids, keys)):
            where = placer.placement(tid) if placer.active else None
            groups.setdefault((where, key), []).append(i)
        return list(groups.values())

    def agree(self, ids: list[int]) -> None:
        """Every worker holding one of ``ids`` learns now whether any replica or piece of it
        failed, in one agreement per group of workers (see Placer.agree_on)."""
        self.dispatcher.agree(ids)

    def device_of(self, tensor_id: int) -> torch.device:
        """The device of the first worker that holds a tensor."""
        d = self.dispatcher
        rank = d.placer.placement(tensor_id).mesh[0] if d.placer.active else d.home
        return torch.device(d.devices.get(rank, "cpu"))

    # reads and waits -----------------------------------------------------------------------

    def read(self, tensor_id: int, sig: tuple) -> np.ndarray:
        """The raw bytes of a tensor's whole value (sig: its shape and dtype); waits for the
        work it depends on."""
        shape, dtype = sig
        buf = np.empty(shape.numel() * dtype.itemsize, np.uint8)
        while True:
            fault = self.dispatcher.read(tensor_id, buf, sig)
            if fault is None:
                return buf
            if not self._told(fault):
                raise self.error(fault)
            # another worker's note of an in-place op skipped for a failure already raised:
            # the worker sent it instead of the data, so ask again

    def error(self, fault: Fault) -> WorkerError:
        self.faults_raised += 1
        self._reported[fault[:3]] = None
        if len(self._reported) > 1024:
            del self._reported[next(iter(self._reported))]
        return worker_error(fault, self.site(fault.tensor_id))

    def _told(self, fault: Fault) -> bool:
        """Whether this is a skipped in-place op's note of a failure already raised (each
        worker that skipped one for it sends a note)."""
        return bool(fault.skipped) and fault[:3] in self._reported

    def synchronize(self) -> None:
        """Wait for all issued work; raise the Fault of an in-place op that a worker skipped
        since the last read or sync, unless its failure was raised already."""
        for fault in self.dispatcher.ask_all("sync", Tag.SYNC).values():
            if fault is not None and not self._told(fault):
                raise self.error(fault)

    def set_backend(self, name: str, value: Any) -> None:
        """A torch kernel setting (ops/settings.py), on rank 0 and on every worker."""
        settings.apply(name, value)
        self.dispatcher.post("backend", (name, value), sorted(self.workers))

    def worker_stats(self, reset_peak: bool = False) -> dict[int, dict]:
        return self.dispatcher.ask_all("stats", Tag.STATS, (reset_peak,))

    # traces ---------------------------------------------------------------------------------

    def start_trace(self, path: str, gpu_every: int | None = None) -> None:
        from ..recording.session import TraceRun
        if self.tracing is not None:
            raise RuntimeError(f"gtmpi: a trace is already recording to {self.tracing.path}")
        if gpu_every is None:
            gpu_every = int(os.environ.get("GTMPI_TRACE_GPU_EVERY", "32"))
        self.tracing = TraceRun(self, path, gpu_every)
        self.tracing.start()

    def stop_trace(self) -> str:
        run, self.tracing = self.tracing, None
        if run is None:
            raise RuntimeError("gtmpi: no trace is recording")
        return run.stop()

    def fail(self, message: str, dead: tuple[int, ...] = ()) -> None:
        """The run is failing: leave the trace and the instruction log on disk first."""
        if self.dispatcher.log is not None:
            self.dispatcher.log.flush()
        run, self.tracing = self.tracing, None
        if run is None or run.stopping:
            return
        try:
            path = run.stop(failure=message, dead=dead)
        except Exception as e:  # the run's own error matters more than the trace's
            print(f"gtmpi: the trace could not be written: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
        else:
            print(f"gtmpi: trace of the failed run written to {path}", file=sys.stderr, flush=True)

    def _dead(self) -> tuple[int, ...]:
        """The workers of this host that are gone, the one that went first (by its death
        watcher's note) ahead."""
        here = socket.gethostname()
        dead = tuple(rank for rank, w in self.workers.items()
                     if w["host"] == here and w["pid"] != os.getpid() and not alive(w["pid"]))
        went_first = ending.first((here, os.getpid()), dead, NOTES_WAIT_S) if dead else None
        return tuple(sorted(dead, key=lambda rank: rank != went_first))

    def _watchdog(self) -> None:
        """Called now and then while rank 0 waits (and, for workers it spawned, by watch_idle
        while it does not): a dead worker on this host ends the job."""
        dead = self._dead()
        if not dead:
            return
        w = self.workers[dead[0]]
        message = f"gtmpi: worker rank {dead[0]} (pid {w['pid']} on {w['host']}) died"
        self.fail(message, dead)
        if self._abort is not None:
            self._abort(message)
        raise RuntimeError(message)

    def watch_idle(self, every_s: float = 0.25) -> None:
        """Workers this process spawned are no job of mpiexec's with it: nothing ends it when
        one dies while the program computes on its own or sleeps. A thread checks them and
        hands a death to the program's thread (as a signal), whose watchdog ends the job."""
        def watch() -> None:
            while not self.closed:
                if self._dead():
                    self.death_pending = True
                    # to the main thread itself: a sleep or a wait there ends at once
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
                    return
                time.sleep(every_s)
        threading.Thread(target=watch, name="gtmpi-worker-watch", daemon=True).start()

    def close(self, timeout_s: float = 30.0) -> list[int]:
        """Stop every worker, waiting (bounded) for each to say goodbye; return the ranks that
        did not."""
        if self.closed:
            return []
        if self.tracing is not None:
            self.stop_trace()
        self.closed = True
        missing = self.dispatcher.shutdown(timeout_s)
        if self.monitor is not None:
            self.monitor.close()
            try:
                os.unlink(self.monitor.port_file)
            except OSError:
                pass
        if self.dispatcher.log is not None:
            self.dispatcher.log.close()
        return missing


    def adopt(self) -> None:
        """The calling thread becomes the one this session serves, if it has none that still
        runs; otherwise a clear error."""
        me = threading.current_thread()
        with _starting:
            if self.thread is None or not self.thread.is_alive():
                self.thread, self.thread_id = me, me.ident
                return
        raise RuntimeError(
            f"gtmpi: this session serves the thread {self.thread.name!r}; thread {me.name!r} "
            "cannot issue ops or reads. gtmpi runs one program thread per process: issue every "
            "op from that thread and hand other threads plain data (numpy arrays, numbers)")


_current: Runtime | None = None
_starting = threading.Lock()


def runtime() -> Runtime:
    """The session, started as the embedded default if nothing started it yet."""
    global _current
    rt = _current
    if rt is None:
        with _starting:
            if _current is None:
                _current = _start_default()
                _current.begin()
            rt = _current
    if rt.thread_id != threading.get_ident():
        rt.adopt()
    return rt


def set_runtime(rt: Runtime) -> None:
    """``rt`` becomes the session, then takes what the environment asks of it (begin())."""
    global _current
    if _current is not None:
        raise RuntimeError("gtmpi: the session has already started; gtmpi.workers(n) must come "
                           "before the first tensor op")
    early.discard()  # a worker process started at import for the embedded default
    _current = rt
    rt.begin()


def set_default_start(start: Callable[[], Runtime]) -> None:
    """How runtime() starts a session when nothing did (client/embedded.py registers the
    embedded default: this module never imports that one, which imports this)."""
    global _start_default
    _start_default = start


def _start_default() -> Runtime:
    raise RuntimeError("gtmpi: no session and no default to start one (import gtmpi first)")


def current() -> Runtime | None:
    return _current
