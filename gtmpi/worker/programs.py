"""Recorded programs on a worker: kept once, replayed on one word each, op by op or as the
CUDA graph captured of them (worker/graphs.py), with their inputs bound and their outputs
renamed per replay. A mixin of worker.executor.Executor, whose state (env, programs, graphs,
the data plane) it reads and writes."""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import Fault
from ..ops.table import Graph, Knob, derive_seed
from ..recording import events
from ..transport import wire
from ..transport.tags import GRAPH_LATER, Tag
from . import compiled as compiling, graphs

_ABSENT = object()
AT_SIZES_MAX = 4096  # a growing program's instructions kept per size (Executor.at_size)


class Programs:
    def _warm_compile(self, out, args: tuple) -> None:
        """(): a program will ask to compile (gtmpi.compile): compiling's first-use costs
        paid meanwhile, once, where that compile would run (worker/compiled.py warm_up)."""
        if not self._warm_started:
            self._warming = compiling.warm_up(self.device, asked=True)
            self._warm_started = self._warming is not None

    def _program(self, out, args: tuple) -> None:
        """(key, instructions): keep a recorded sequence; (key, None): drop it."""
        key, instructions = args
        if self.slot and instructions is not None:
            # a server's client: what a replay runs is checked as a batch is, once, here; a
            # program holds ops and the words a recording keeps (frees), never programs
            wire.check(instructions, self.client_words - {"program", "replay"})
        self.graphs.pop(key)
        if instructions is None:
            for at in [at for at in self.at_size if at[0] == key]:
                del self.at_size[at]
            self.programs.pop(key, None)
            self.seeded.pop(key, None)
            self.sized.pop(key, None)
            self.knobbed.pop(key, None)
            self.grown.pop(key, None)
            self.dynamic.pop(key, None)
        else:
            self.programs[key] = instructions
            self.seeded[key] = graphs.seeded(instructions)
            self.sized[key] = graphs.sized(instructions)
            self.knobbed[key] = graphs.seeded(instructions, Knob)

    def _replay(self, out, args: tuple) -> None:
        """(key, binds, renames, mode, seeds): run a kept sequence again. Its inputs are bound
        to the ids it was recorded with, (current, recorded) in ``binds``, for the run only;
        every tensor it makes keeps its recorded id, and those that outlive it move to fresh
        ids (``renames``), so that the next run cannot overwrite what the program still holds.
        Its random ops take seeds derived from ``seeds`` (session seed, count before the call).
        ``mode``: 'plain', op by op; 'capture', capture it as a CUDA graph and say whether that
        worked (the dispatcher's 'commit' then runs it); 'emulate', the same with the stand-in
        backend (tests); 'graph', launch the graph. A sixth item, the call's growing size,
        gives its sizes (ops/table.py: Dim); each size is a graph of its own, or, with mode
        'compile', the program is compiled for every size (and says whether that worked, as a
        capture does), then run so ('compiled') where the compiled program fits the size. A
        seventh, the values of its Knobs (an optimizer's rate), by their index; such a program
        runs op by op. A capture's or compile's mode names a compile mode after a colon
        ('capture:inductor', worker/compiled.py): the graph captured is of the compiled
        program."""
        key, binds, renames, mode, seeds = args[:5]
        mode, _, compile_mode = mode.partition(":")
        if compile_mode == "auto" and self.device.type != "cuda":
            compile_mode = ""
        size = args[5] if len(args) > 5 else None
        knobs = args[6] if len(args) > 6 else None
        if self.profiler is not None:
            self.profiler.saw(self.programs[key])
        start = self.now()
        if mode == "graph":
            graph = self.graphs[key if size is None else (key, size)]
            if self._launch(graph, binds, renames, seeds) is not None:
                self._run_program(self._instructions(key, seeds, size), binds, renames)
        elif mode == "emulate":
            self._try_capture(key, size, binds, renames, seeds, graphs.EmulatedBackend(),
                              compile_mode)
        elif mode == "capture":
            if self._cuda_backend is None:
                alone = self.plane is None or self.plane.workers == 1
                self._cuda_backend = graphs.cuda_backend(self.device, shared=alone)
            self._try_capture(key, size, binds, renames, seeds, self._cuda_backend,
                              compile_mode)
        elif mode in ("compile", "compiled"):
            done = self._compile_growing(key, size, binds, compile_mode) \
                if mode == "compile" else self.dynamic.get(key)
            fits = done is not None and done.fits(size)
            if fits and not any(cur in self.poison for cur, _ in binds):
                self.stats["sized_compiled"] += 1
                self._run_program(None, binds, renames, (key, done, size, seeds),
                                  lambda: self._instructions(key, seeds, size))
            else:
                self.stats["sized_unfit"] += done is not None and not fits
                self._run_program(self._instructions(key, seeds, size), binds, renames)
        else:
            if size is not None:
                self.grown[key] = (size, _shapes(self.env, binds))
            self._run_program(self._instructions(key, seeds, size, knobs), binds, renames)
        if self.device.type == "cuda" and mode != "capture":
            self._note_ready(new for _, new in renames)
        if self.trace is not None:
            self.trace.event(events.Kind.REPLAY, events.Lane.WORKER, start, self.now(), mode,
                             key, count=len(self.programs[key]))

    def _instructions(self, key: int, seeds: tuple[int, int] | None,
                      size: int | None = None, knobs: tuple | None = None) -> list[tuple]:
        program, where = self.programs[key], self.seeded[key]
        if size is not None:
            at = self.at_size.get((key, size))
            if at is None:
                if len(self.at_size) >= AT_SIZES_MAX:
                    self.at_size.clear()
                at = self.at_size[key, size] = graphs.with_sizes(program, self.sized[key], size)
            program = at
        if knobs is not None:
            program = graphs.with_seeds(program, self.knobbed[key], lambda k: knobs[k.index])
        if not where:
            return program
        session, base = seeds
        return graphs.with_seeds(program, where, lambda s: derive_seed(session, base + s.offset))

    def _run_program(self, program: list[tuple] | None, binds: tuple, renames: tuple,
                     compiled: tuple | None = None,
                     instructions: Callable[[], list[tuple]] | None = None) -> None:
        """Run ``program`` with its inputs bound, or ``compiled`` (the program's key, the
        program compiled, the size, the seeds), whose ``instructions`` run in its stead if it
        raises (an op's own failure is then the op's, as written), as they do from then on."""
        # a recorded input may still be alive (a batch used again): it is itself again after
        saved = self._saved(recorded for _, recorded in binds)
        self._move(binds, keep=True)
        if compiled is None:
            self._execute(program)
        else:
            key, done, size, seeds = compiled
            if self.waits:
                self._settle_all()
            done.seed(seeds)
            try:
                done.run(self.env, size)
                self.stats["ops"] += done.ops
            except Exception:
                self.dynamic.pop(key, None)
                self._execute(instructions())
        self._restore(saved)
        self._move(renames, keep=False)

    def _compile_growing(self, key: int, size: int, binds: tuple,
                         mode: str) -> compiling.Compiled | None:
        """A growing program compiled for every size (worker/compiled.py), kept; rank 0 told
        whether that worked (None) or why not, and how the compiling went."""
        why, notes = None, []
        grew = compiling.growth(self.grown.get(key, (size, {})), size, _shapes(self.env, binds))
        if not mode:
            why = "GTMPI_COMPILE=auto compiles nothing on a CPU worker"
        elif self.knobbed[key]:
            why = "numbers in it change per call"
        elif isinstance(grew, str):
            why = grew
        else:
            program = self.programs[key]
            values = {recorded: self.env[cur] for cur, recorded in binds}
            values.update((tid, self.env[tid])
                          for tid in graphs.outside_reads(program, set(values)))
            done = self._compiled(key, program, values, mode, notes,
                                  compiling.Growing(size, self.sized[key], grew))
            if done is None:
                why = notes.pop().removeprefix("not compiled: ")
            else:
                self.dynamic[key] = done
        self.link.reply(Tag.GRAPH, (why, notes[0] if notes else None))
        return self.dynamic.get(key)

    def _by_id(self) -> tuple[dict, ...]:
        """Every table that says what an id is here: its value, its fault, the collective still
        making it, the GPU event it is final at. Moving, saving and restoring an id touch them
        all (a run that restored the value but not the event kept a bound input alive through
        its event: an iteration's activations, for good)."""
        return self.env, self.poison, self.waits, self.ready

    def _saved(self, ids) -> list:
        """What ``ids`` are now, for _restore."""
        tables = self._by_id()
        return [(i, [t.get(i, _ABSENT) for t in tables]) for i in ids]

    def _restore(self, saved: list) -> None:
        tables = self._by_id()
        for recorded, values in saved:
            for table, value in zip(tables, values):
                if value is _ABSENT:
                    table.pop(recorded, None)
                else:
                    table[recorded] = value

    def _try_capture(self, key: int, size: int | None, binds: tuple, renames: tuple, seeds,
                     backend, compile_mode: str) -> None:
        """Capture a program as a graph (nothing runs yet) and tell rank 0 whether it worked
        (None) or why not, and how its compiling went (a note, or None); the capture waits
        for the dispatcher's commit."""
        if self._warming is not None:  # compiling's warm-up (worker/compiled.py) ends first
            self._warming.join()
            self._warming = None
        captured, why = None, backend if isinstance(backend, str) else None
        notes: list[str] = []
        if why is None:
            try:
                captured = self._capture_graph(key, size, binds, renames, backend,
                                               compile_mode, notes)
            except Exception as e:  # what cannot be captured: a host sync, a data-dependent shape
                why = _why(e)
        self._capture = (key, size, binds, renames, seeds, captured)
        self.link.reply(Tag.GRAPH, (why, notes[0] if notes else None))

    def _compiled(self, key: int, program: list[tuple], values: dict, mode: str,
                  notes: list[str], growing: compiling.Growing | None = None
                  ) -> compiling.Compiled | None:
        """``program`` compiled (worker/compiled.py) for the inputs ``values`` (a growing
        program's for every size), or None with the reason in ``notes``; the time it took in
        the trace."""
        start = self.now()
        try:
            done = compiling.compile_program(program, list(values), values, mode, self.device,
                                             self.plane, growing)
        except Exception as e:  # refused, or what the trace or Inductor raised
            done = None
            notes.append(f"not compiled: {_why(e, last=True)}")
        else:
            notes.append(done.note())
        self.stats["compiles" if done else "compile_refusals"] += 1
        if self.trace is not None:
            self.trace.event(events.Kind.REPLAY, events.Lane.WORKER, start, self.now(),
                             "compile", key, count=len(program), detail=notes[-1])
        return done

    def _capture_graph(self, key: int, size: int | None, binds: tuple, renames: tuple,
                       backend: graphs.CudaBackend | graphs.EmulatedBackend,
                       compile_mode: str, notes: list[str]) -> graphs.Captured:
        program = self.programs[key] if size is None else \
            graphs.with_sizes(self.programs[key], self.sized[key], size)
        program = [ins for ins in program if ins[0] not in graphs.HOST_WORDS]
        for i, ins in enumerate(program):
            if ins[0] in ("upload", "read", "sync"):
                raise RuntimeError(f"instruction {i} ({ins[0]}) waits for the host")
        env, poison = self.env, self.poison
        # one list of inputs serves every worker: a pipeline stage holds only its own
        binds = tuple((cur, recorded) for cur, recorded in binds if cur in env or cur in poison)
        reads = graphs.outside_reads(program, {recorded for _, recorded in binds})
        for tid in [cur for cur, _ in binds] + reads:
            if tid in poison:
                raise RuntimeError(f"tensor {tid} it reads failed: {poison[tid].error}")
            if tid not in env:
                raise RuntimeError(f"tensor {tid} it reads is not here")
        if self.waits:
            self._settle_all()
        if self.plane is not None:
            self.plane.settle_sends()
        if not backend.emulated and any(  # tags.GRAPH_LATER (the stand-in makes records afresh)
                isinstance(env[cur], Graph) and not self.graphs.made(env[cur]) for cur, _ in binds):
            raise RuntimeError(f"an autograd record it reads is made outside a graph {GRAPH_LATER}")
        inputs, shared = {}, set()
        for cur, recorded in binds:
            inputs[recorded], same = self.graphs.bind(env[cur])
            if same and isinstance(inputs[recorded], torch.Tensor):
                shared.add(recorded)
            elif not same:
                self.stats["graph_input_bytes"] += inputs[recorded].nbytes
        saved = self._saved(inputs)
        compiled = None
        if compile_mode and size is not None:
            # a graph per size of a growing call: a compile each would cost more than it saves
            notes.append("not compiled: its sizes follow its call's")
        elif compile_mode:
            values = {**inputs, **{tid: env[tid] for tid in reads}}
            compiled = self._compiled(key, program, values, compile_mode, notes)

        def execute(instructions: list[tuple]) -> None:
            env.update(inputs)
            try:
                if backend.emulated:  # as a graph's end joins them, every collective is waited
                    if compiled is None:
                        self._execute(instructions)
                    else:
                        compiled.run(env)
                    self._settle_all()
                else:
                    self._captured(instructions, compiled)
            finally:
                self._restore(saved)

        held, poisoned = set(env), set(poison)
        counts = self._comm_counts()
        skipped, pending = self.stats["skipped"], self.skipped
        try:
            handle = backend.capture(program, execute)
            failed = [poison[t] for t in set(poison) - poisoned]
            if failed or self.stats["skipped"] != skipped:
                bad = failed[0] if failed else self.skipped
                raise RuntimeError(f"op '{bad.op}' failed while captured: {bad.error}")
        except BaseException:
            # what the capture made, or failed to make: none of it ran, nor is it reported
            for tid in (set(env) - held) | (set(poison) - poisoned):
                env.pop(tid, None)
                poison.pop(tid, None)
                self.waits.pop(tid, None)
            self.skipped = pending
            self._count_as(counts)
            raise
        after = self._comm_counts()
        comm = {} if backend.emulated else {  # an emulated launch runs (and counts) them itself
            k: (v[0] - counts.get(k, (0, 0))[0], v[1] - counts.get(k, (0, 0))[1])
            for k, v in after.items() if v != counts.get(k)}
        self._count_as(counts)  # captured, not run: each launch counts them
        return graphs.Captured(handle, inputs, [(tid, env[tid]) for tid in reads], comm,
                               len(program), graphs.written_inputs(program, set(inputs)),
                               frozenset(shared), compiled)

    def _captured(self, program: list[tuple], compiled: compiling.Compiled | None) -> None:
        """The program's instructions (or the program compiled) inside a capture: no GPU
        timing events, and every collective and send joined back before the capture ends."""
        gpu_every, self._gpu_every = self._gpu_every, 0
        self._plane_capture(True)
        try:
            if compiled is None:
                self._execute(program)
            else:
                compiled.run(self.env)
            self._settle_all()
        finally:
            self._plane_capture(False)
            self._gpu_every = gpu_every

    def _plane_capture(self, on: bool) -> None:
        if self.plane is not None and self.plane.started:
            if on:
                self.plane.begin_capture()
            else:
                self.plane.end_capture()

    def _comm_counts(self) -> dict[str, tuple[int, int]]:
        return {k: tuple(v) for k, v in self.plane.stats.items()} if self.plane else {}

    def _count_as(self, counts: dict[str, tuple[int, int]]) -> None:
        """The collectives counted as ``counts`` says (what a capture recorded never ran)."""
        if self.plane is not None:
            stats = self.plane.stats
            for k in list(stats):
                if k in counts:
                    stats[k][:] = counts[k]
                else:
                    del stats[k]

    def _commit(self, out, args: tuple) -> None:
        """(key, ok): every worker of the program captured it (launch the graph, and from now
        on every replay), or one could not (run it op by op; the graph is dropped)."""
        key, ok = args
        _, size, binds, renames, seeds, captured = self._capture
        self._capture = None
        if ok:
            self.graphs.add(key if size is None else (key, size), captured)
        if not ok or self._launch(captured, binds, renames, seeds) is not None:
            self._run_program(self._instructions(key, seeds, size), binds, renames)
        if self.device.type == "cuda":
            self._note_ready(new for _, new in renames)

    def _launch(self, captured: graphs.Captured, binds: tuple, renames: tuple,
                seeds) -> str | None:
        """One call of a captured program: inputs into its static buffers, the graph launched,
        its outputs handed out under the call's ids. An input or read that failed (or is not
        what was captured) fails the outputs with it, but the graph still runs: the other
        members' collectives inside it wait for this one's. Where the graph cannot keep what
        the client holds, it launches nothing and says why (Captured.unlaunchable): run it op by
        op."""
        env, poison = self.env, self.poison
        if self.waits:
            self._settle_all()
        why = captured.unlaunchable(env, binds)
        if why is not None:
            self.stats["graph_fallbacks"] += 1
            reasons = self.stats["graph_fallback_reasons"]
            reasons[why] = reasons.get(why, 0) + 1
            return why
        outputs = tuple(recorded for recorded, _ in renames)
        aside = self.graphs.clear_way(captured, env)
        # before the inputs are copied in: an output may view one
        copied = captured.copy_out(env) if captured.outputs else []
        self.stats["graph_copies"] += len(copied) + len(aside)
        if copied and self.ready:
            self._note_ready(i for i in copied if i in self.ready)
        fault = None
        inputs = captured.inputs
        for cur, recorded in binds:
            static = inputs.get(recorded)
            if static is None:
                continue
            t = env.get(cur)
            if t is not None:
                # through .data: an autograd record may have saved the buffer, and a graph
                # rewrites what it saved without a version change, as this copy must too
                if t is not static:  # an autograd record is the captured one (unlaunchable)
                    static.data.copy_(t)
            elif fault is None:
                fault = poison.get(cur) or Fault(cur, "replay", self.rank, "an input is not here")
        for tid, t in captured.reads:
            if env.get(tid) is not t and fault is None:
                fault = poison.get(tid) or Fault(tid, "replay", self.rank,
                                                 f"tensor {tid} is not the one captured")
        captured.handle.seed(seeds)
        if captured.compiled is not None:
            captured.compiled.seed(seeds)
        captured.handle.replay(env, outputs)
        for storage, saved in aside:
            storage.copy_(saved)
        if captured.written and fault is None:
            for cur, recorded in binds:
                if recorded in captured.written and env[cur] is not inputs[recorded]:
                    env[cur].copy_(inputs[recorded])
        if not captured.outputs:  # the first launch: its outputs are the graph's for good
            captured.set_outputs(env, outputs)
            self.graphs.launched(captured)
        # an op of the stand-in's program failed (a real graph's kernels never fail on the
        # host): every output fails with it, as with a failed input
        failed = [poison.pop(recorded) for recorded in outputs if recorded in poison]
        fault = fault or (failed[0] if failed else None)
        # a graph leaves its outputs where they were captured; the stand-in puts them (and
        # the autograd records it made afresh) under the recorded ids
        made = {recorded: env.pop(recorded) for recorded in outputs if recorded in env}
        if fault is None:
            statics = captured.outputs
            for recorded, value in made.items():
                if recorded in statics and not isinstance(value, torch.Tensor):
                    # the stand-in's record, made afresh: the one whose holding keeps the
                    # next launch from rewriting what it saved (Captured.holds_record), as a
                    # graph's one record does
                    statics[recorded] = value
            env.update((new, made.get(recorded, statics.get(recorded))) for recorded, new in
                       renames if recorded in made or recorded in statics)
            captured.handed = [new for _, new in renames]
        else:
            self._fail(tuple(new for _, new in renames), fault)
        self.stats["graph_launches"] += 1
        self.stats["graphed_ops"] += captured.size
        if self.plane is not None:
            for k, (count, nbytes) in captured.comm.items():
                entry = self.plane.stats[k]
                entry[0] += count
                entry[1] += nbytes
        return None

    def _rename(self, out, pairs: tuple) -> None:
        self._move(pairs, keep=False)

    def _move(self, pairs: tuple, keep: bool) -> None:
        """Each (a, b) of ``pairs``: b becomes what a is (Executor._by_id); a keeps it too if
        ``keep``. Ids not held here are skipped: one list serves every worker."""
        tables = self._by_id()
        for a, b in pairs:
            for table in tables:
                if a in table:
                    table[b] = table[a] if keep else table.pop(a)


def _shapes(env: dict, binds: tuple) -> dict[int, tuple]:
    """The (sizes, strides) of a replay's bound tensors, by their recorded ids."""
    return {recorded: (tuple(t.shape), t.stride()) for cur, recorded in binds
            if isinstance(t := env.get(cur), torch.Tensor)}


def _why(e: Exception, last: bool = False) -> str:
    """The exception's first line; with ``last``, its last too (where a compiler's subprocess
    said what failed, after a first line that says only that one did)."""
    lines = [line.strip() for line in f"{type(e).__name__}: {e}".splitlines() if line.strip()]
    if last and len(lines) > 1:
        return f"{lines[0][:200]} ... {lines[-1][:300]}"
    return lines[0][:300]
