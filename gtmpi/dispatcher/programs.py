"""Recorded instruction sequences: what the workers ran for one call of a replayable function
(client/replay.py), kept on each worker and run again on one word per worker per call; on GPU
workers, from a warm replay on, launched as one CUDA graph per call (worker/graphs.py).

While a call is recorded, every placed instruction the dispatcher sends (collectives and
transfers it inserted included) is also appended to its worker's program, and runs as usual.
Ids made during the recording (the client's, counting up; the placer's own, counting down) are
the program's: a replay makes them again under the same ids and frees those it freed, so the
program needs no renaming. Everything else it reads is outside it: the inputs, bound per call
(worker: _replay), and the rest (weights, optimizer state, kept copies), read where they are.
"""
from __future__ import annotations

from typing import Any


class Recording:
    """The instructions each worker is sent while one call runs."""

    def __init__(self, first_id: int, first_temp: int) -> None:
        self.first_id = first_id  # client ids from here on are made inside
        self.first_temp = first_temp  # and placer ids from here down
        self.per_rank: dict[int, list[tuple]] = {}
        self.random_ops = 0  # seeds handed out inside (client/runtime.py: next_seed)

    def inside(self, tid: int) -> bool:
        return tid >= self.first_id or tid <= self.first_temp

    def add(self, rank: int, ins: tuple) -> None:
        if ins[0] == "free":  # a tensor from before dropped now stays dropped: not replayed
            ids = tuple(i for i in ins[2] if self.inside(i))
            if not ids:
                return
            ins = ("free", None, ids, 0, None)
        self.per_rank.setdefault(rank, []).append(ins)

    def made_and_read(self) -> tuple[set[int], set[int], set[int]]:
        """Client ids the program makes and frees, and the ids from outside that it reads."""
        made: set[int] = set()
        freed: set[int] = set()
        read: set[int] = set()
        for program in self.per_rank.values():
            for name, out, args, tmask, _ in program:
                if name == "free":
                    freed.update(args)
                    continue
                for o in ((out,) if type(out) is int else out or ()):
                    if o >= self.first_id:
                        made.add(o)
                i = 0
                while tmask >> i:
                    if tmask >> i & 1 and not self.inside(args[i]):
                        read.add(args[i])
                    i += 1
        return made, freed, read


class Graphing:
    """Whether a program, or one size of a growing one, runs as a CUDA graph: each is
    captured at a warm replay of its own (a graph holds the shapes it was captured with)."""

    def __init__(self) -> None:
        self.replays = 0
        # None until a capture is tried; then True (its workers launch it as a CUDA graph) or
        # why it runs without one
        self.graph: bool | str | None = None
        self.captures = 0  # captures tried: one a worker put off is tried again, a few times


class Program(Graphing):
    """A recording installed on its workers."""

    def __init__(self, key: int, name: str, ranks: tuple[int, ...], reads: frozenset[int],
                 before: tuple[tuple[int, Any], ...], changed: tuple[tuple[int, Any], ...],
                 outputs: tuple[tuple[int, Any, bool], ...], random_ops: int,
                 auto: bool = False) -> None:
        self.key = key
        self.name = name  # the replayable function and where it was recorded, for notes
        self.ranks = ranks
        self.reads = reads  # ids from outside it reads (besides its inputs): freed, it is stale
        self.before = before  # (id, the placer's entry for it) at the start of the recording
        self.placed = any(entry is not None for _, entry in before)
        self.changed = changed  # (id, entry) of tensors from outside that it placed anew
        self.outputs = outputs  # (recorded id, the placer's entry for it, whether viewed)
        self.random_ops = random_ops
        # how its maker asks it compiled where GTMPI_COMPILE is not set: 'auto' for what
        # gtmpi.compile was given (dispatcher.compile_mode), '' for the rest
        self.compile = ""
        self.auto = auto  # a repeated run's (dispatcher/repeats.py), not a replayable call's
        # the collectives and transfers the placer inserted while it was recorded, by
        # (site, kind, asked): (count, bytes); each replay counts them again (explain())
        self.inserted: dict[tuple[str, str, bool], tuple[int, int]] = {}
        self.stale = False
        super().__init__()
        # a program whose sizes follow its call's (install's ``sized``): a graph per size
        self.sizes: dict[int, Graphing] | None = None
        # or, under GTMPI_COMPILE, compiled for every size: None until tried, then True or why
        # not (worker/compiled.py)
        self.dynamic: bool | str | None = None
        self.marks = "replay"  # the name its replays' issues carry in a trace (ops/table.py: STEP_OPS)
        self.ops: tuple[str, ...] = ()  # its instructions' ops, every worker's, frees left out
