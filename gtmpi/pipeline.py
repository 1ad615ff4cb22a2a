"""Pipeline parallelism: a model cut into stages, each on its own workers, trained on
micro-batches with GPipe's, 1F1B's, Megatron's interleaved 1F1B, ZB-H1's or ZB-V's (zero
bubble) schedule.

    pipe = gtmpi.pipeline.Pipeline([first, last], ["stage0", "stage1"], micro_batches=8)
    loss = pipe.step(x, y)      # forward and backward of the whole batch; gradients accumulate
    opt.step()

Each stage is a callable (a Module) whose parameters live on its signal's workers (build it
inside ``gtmpi.signal.context(name)``, or move it there with ``gtmpi.signal.place``); the last
stage is called with the targets too and returns the micro-batch's loss. The batch is cut
along dim 0 into micro-batches; the loss returned is their mean (the full batch's loss for a
mean-reduced loss), and the gradients are those of that mean.

One client drives every stage, so the schedule is an order of issuing: each worker runs its
instructions in the order they were issued to it, and the issuing runs ahead of the workers,
so stages really run at the same time, each in its schedule's order. An activation goes from
one stage to the next as a transfer asked for as soon as it is made, its gradient back the
same way: the send goes into the producing stage's stream right behind the work that made
it, and the receive into the consuming stage's stream only where that stage uses it
(dispatcher: deferred receives), so neither stage waits on the other except for the data
itself. Every micro-batch has its own autograd graph, several alive at once (1F1B keeps at
most p - s of them on stage s; GPipe all m).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from . import signals
from .autograd import engine, no_grad
from .client.runtime import runtime
from .client.tensor import Tensor

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")


def issue_order(name: str, stages: int, micro_batches: int,
                virtual: int = 1) -> list[tuple[str, int, int]]:
    """The order of issuing: (``"F"`` or ``"B"``, stage, micro-batch) for every forward and
    backward of every stage (and ``"W"``, a weight-gradient pass, for ZB-H1 and ZB-V), a valid
    order of the dependencies (F(s, i) after F(s-1, i); B(s, i) after F(s, i) and B(s+1, i))
    in which each stage meets its own actions in the schedule's order: GPipe, every forward then
    every backward; 1F1B, p - s - 1 forwards to fill the pipeline, then one forward and one backward
    in turn, then the remaining backwards. "interleaved" (Megatron's interleaved 1F1B): each
    of the ``stages`` workers holds ``virtual`` chunks of the model, chunk j of worker r being
    stage j * p + r of p * v, and runs them in Megatron's order (forwards p micro-batches per
    chunk at a time, a longer warm-up, then one forward and one backward in turn). "zbh1" and
    "zbv" split each backward in B and W (_zero_bubble); ZB-V's 2p stages are two chunks per
    worker laid out in a V (worker_of), whatever ``virtual`` says."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: one of {', '.join(SCHEDULES)}")
    p, m = stages, micro_batches
    if name == "zbh1":  # at most p micro-batches held on every stage: 1F1B's first stage's
        return _zero_bubble(p, m, p, lambda c: c, lambda w: p)
    if name == "zbv":  # 2p chunks' worth on every worker: the same memory
        return _zero_bubble(p, m, 2 * p, lambda c: worker_of(name, c, p), lambda w: 2 * p)
    if name == "interleaved":
        return _in_ticks(_interleaved(p, m, virtual), p * virtual, m)
    per_stage = []
    for s in range(p):
        if name == "gpipe":
            order = [("F", s, i) for i in range(m)] + [("B", s, i) for i in range(m)]
        else:
            warm = min(p - s - 1, m)
            order = [("F", s, i) for i in range(warm)]
            for i in range(m - warm):
                order += [("F", s, warm + i), ("B", s, i)]
            order += [("B", s, i) for i in range(m - warm, m)]
        per_stage.append(order)
    return _in_ticks(per_stage, p, m)


def _needs(kind: str, s: int, i: int, stages: int) -> list[tuple[str, int, int]]:
    """The actions action (kind, s, i) waits for: a forward for the previous stage's, a
    backward (B) for its forward's and the next stage's B, a weights' pass (W) for its B."""
    if kind == "F":
        return [("F", s - 1, i)] if s else []
    if kind == "B":
        return [("F", s, i)] + ([("B", s + 1, i)] if s < stages - 1 else [])
    return [("B", s, i)]


def _interleaved(p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Each worker's actions in Megatron's interleaved 1F1B (its
    forward_backward_pipelining_with_interleaving): the k-th forward is of chunk (k // p) % v
    and micro-batch (k // pv) p + k % p, the k-th backward the same with the chunks taken
    last first; (p - r - 1) * 2 + (v - 1) * p forwards warm worker r up."""
    if v < 1 or m % p:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({m}) a multiple of the stages "
                         f"({p}) and one chunk or more per stage (got {v})")
    total = m * v

    def micro_batch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    out = []
    for r in range(p):
        forwards = [("F", (k // p) % v * p + r, micro_batch(k)) for k in range(total)]
        backwards = [("B", (v - 1 - (k // p) % v) * p + r, micro_batch(k)) for k in range(total)]
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        order = forwards[:warm]
        for k in range(total - warm):
            order += [forwards[warm + k], backwards[k]]
        out.append(order + backwards[total - warm:])
    return out


def _in_ticks(per_worker: list[list[tuple[str, int, int]]], stages: int,
              m: int) -> list[tuple[str, int, int]]:
    """Each worker's actions merged tick by tick: each worker takes its next action once what
    it needs was done in an earlier tick, the order of a real run's timeline, and so a valid
    one."""
    done: set[tuple[str, int, int]] = set()
    nxt = [0] * len(per_worker)
    out: list[tuple[str, int, int]] = []
    while len(out) < 2 * stages * m:
        ready = []
        for w, actions in enumerate(per_worker):
            if nxt[w] == len(actions):
                continue
            kind, s, i = actions[nxt[w]]
            if all(n in done for n in _needs(kind, s, i, stages)):
                ready.append((w, (kind, s, i)))
        if not ready:
            raise AssertionError("pipeline schedule stalled")  # a bug in the orders above
        for w, action in ready:
            nxt[w] += 1
            out.append(action)
        done.update(action for _, action in ready)
    return out


def worker_of(schedule: str, chunk: int, stages: int) -> int:
    """Which of the ``stages`` workers (pipeline ranks) holds ``chunk`` of the model: chunk c
    on worker c % p (interleaved: Megatron's round robin), or in a V for ZB-V (chunks 0 and
    2p - 1 on worker 0, 1 and 2p - 2 on worker 1, ...: each worker's two chunks are its
    forward's way down and back, so the last chunk, with the head, sits beside the first)."""
    if schedule == "zbv" and chunk >= stages:
        return 2 * stages - 1 - chunk
    return chunk % stages


def _zero_bubble(p: int, m: int, chunks: int, where: Callable[[int], int],
                 in_flight: Callable[[int], int]) -> list[tuple[str, int, int]]:
    """Zero-bubble orders (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): each backward
    split into B, the input's gradient (which the previous stage waits for), and W, the
    weights' (which nobody waits for). Tick by tick each worker takes a ready B first (of its
    deepest chunk), else a ready forward (of its deepest chunk) while fewer than
    ``in_flight(worker)`` micro-batches' chunks are held (the memory bound), else a W it owes,
    oldest first: the W's fill what would be 1F1B's bubbles. A micro-batch's chunk is held
    from its F to its W, not to its B: W reads the linear layers' inputs and their outputs'
    gradients (counted to B, every W waited for the step's end, and a PP=2 GPT-2 small at
    micro-batches of 8 peaked at 14-15 GiB per stage in the dry run, against 1F1B's 3.9).
    ``chunks`` stages of the model, chunk c on worker ``where(c)``."""
    done: set[tuple[str, int, int]] = set()
    nf, nb = [0] * chunks, [0] * chunks  # per chunk: forwards and B's issued
    mine = [[c for c in range(chunks) if where(c) == w] for w in range(p)]
    alive = [0] * p  # per worker: chunks' forwards whose W has not been issued
    owed: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # per worker: W's to issue
    out: list[tuple[str, int, int]] = []
    while len(out) < 3 * chunks * m:
        tick = []
        for w in range(p):
            bs = [c for c in mine[w] if nb[c] < nf[c] and
                  (c == chunks - 1 or ("B", c + 1, nb[c]) in done)]
            fs = [c for c in mine[w] if nf[c] < m and (c == 0 or ("F", c - 1, nf[c]) in done)]
            if bs:
                c = max(bs)
                tick.append(("B", c, nb[c]))
                owed[w].append((c, nb[c]))
                nb[c] += 1
            elif fs and alive[w] < in_flight(w):
                c = max(fs)
                tick.append(("F", c, nf[c]))
                nf[c] += 1
                alive[w] += 1
            elif owed[w]:
                c, i = owed[w].pop(0)
                tick.append(("W", c, i))
                alive[w] -= 1
        if not tick:
            raise AssertionError("pipeline schedule stalled")  # a bug in the rule above
        out += tick
        done.update(tick)
    return out


def makespan(order: list[tuple[str, int, int]], stages: int, cost: dict[str, float],
             workers: int | None = None, schedule: str = "1f1b") -> float:
    """When the last action of ``order`` ends, each worker running its actions in the issued
    order, each as soon as its worker is free and what it needs has ended (``cost`` per kind:
    "F", "B", and "W" where the schedule splits the backward). Stage s runs on worker
    worker_of(schedule, s, ``workers``) (chunks of interleaved or ZB-V), by default on its
    own."""
    workers = workers or stages
    free, end = [0.0] * workers, {}
    for kind, s, i in order:
        w = worker_of(schedule, s, workers)
        start = max([free[w]] + [end[n] for n in _needs(kind, s, i, stages)])
        end[(kind, s, i)] = free[w] = start + cost[kind]
    return max(free)


def bubble(stages: int, micro_batches: int, schedule: str = "1f1b", virtual: int = 1) -> float:
    """The idle fraction of a worker in the schedule, its forward, input-gradient and weight-
    gradient passes of equal cost: GPipe's and 1F1B's (p - 1) / (m + p - 1), ZB-H1's, ZB-V's
    and interleaved 1F1B's less (a chunk of ``virtual``, or of ZB-V's 2, costs 1/v of a
    stage)."""
    order = issue_order(schedule, stages, micro_batches, virtual)
    split = schedule in ("zbh1", "zbv")
    cost = {"F": 1, "B": 1, "W": 1} if split else {"F": 1, "B": 2}
    v = 2 if schedule == "zbv" else virtual if schedule == "interleaved" else 1
    cost = {k: c / v for k, c in cost.items()}
    return 1 - 3 * micro_batches / makespan(order, stages * v, cost, stages, schedule)


class Pipeline:
    def __init__(self, stages: Sequence[Callable], signals_: Sequence[str], micro_batches: int,
                 schedule: str = "1f1b") -> None:
        if len(stages) != len(signals_) or not stages:
            raise ValueError(f"{len(stages)} stages need as many signals, got {len(signals_)}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be positive, got {micro_batches}")
        self.stages, self.signals = list(stages), list(signals_)
        self.micro_batches = micro_batches
        # interleaved and ZB-V: stage c (a chunk of the model, in order) on the workers of the
        # worker_of(c)-th of the p signals, which each hold len(stages) / p chunks (ZB-V: 2)
        chunked = schedule in ("interleaved", "zbv")
        self.workers = list(dict.fromkeys(self.signals)) if chunked else self.signals
        p = len(self.workers)
        self.virtual = len(self.stages) // p
        if len(self.stages) != p * self.virtual or (schedule == "zbv" and self.virtual != 2) or \
                any(name != self.workers[worker_of(schedule, c, p)]
                    for c, name in enumerate(self.signals)):
            where = "in a V, two per signal (0 1 .. p-1 p-1 .. 1 0)" if schedule == "zbv" \
                else "to the (c % p)-th of the p signals"
            raise ValueError(f"{schedule} stages: chunk c goes {where}, got {self.signals}")
        self.order = issue_order(schedule, p, micro_batches, self.virtual)
        self.schedule = schedule

    def step(self, inputs: Any, targets: Any) -> Tensor:
        """Forward and backward of the batch, micro-batch by micro-batch in the schedule's
        order; gradients accumulate into the stages' parameters. Returns the mean loss."""
        p, m = len(self.stages), self.micro_batches
        self._note_in_trace()
        xs, ys = _cut(inputs, m), _cut(targets, m)
        # (stage, i): its input, the previous stage's output moved here, a leaf where this
        # stage's backward stops
        received: dict[tuple[int, int], Tensor] = {}
        outputs: dict[tuple[int, int], Tensor] = {}  # (stage, i): its output (the loss, last)
        grads: dict[tuple[int, int], Tensor] = {}  # (stage, i): its output's gradient, moved here
        later: dict[tuple[int, int], engine.Later] = {}  # (stage, i): its W, after its B
        losses = []
        for kind, s, i in self.order:
            if kind == "F":
                out = self._forward(s, xs[i] if s == 0 else received[(s, i)], ys[i])
                if s == p - 1:
                    losses.append(out.detach())
                    out = out / m
                else:
                    received[(s + 1, i)] = signals.tensor(
                        out.detach(), self.signals[s + 1]).requires_grad_()
                outputs[(s, i)] = out
            elif kind == "W":
                with signals.context(self.signals[s]):
                    later.pop((s, i)).run()
            else:
                with signals.context(self.signals[s]):
                    if self.schedule in ("zbh1", "zbv"):  # B: the input's gradient; W later
                        later[(s, i)] = engine.backward_inputs(
                            outputs.pop((s, i)), grads.pop((s, i), None),
                            [received[(s, i)]] if s else [])
                    else:
                        engine.backward(outputs.pop((s, i)), grads.pop((s, i), None))
                if s:
                    grads[(s - 1, i)] = signals.tensor(received.pop((s, i)).grad,
                                                       self.signals[s - 1])
        return sum(losses[1:], losses[0]) / m

    def _note_in_trace(self) -> None:
        """A trace being recorded learns the stages' workers and the schedule, from which
        gtmpi-trace idle reports each stage's bubble against (p-1)/(m+p-1)."""
        rt = runtime()
        if rt.tracing is None:
            return
        book = rt.signals
        rt.tracing.pipeline = {
            "stages": [list(book.placement(book.signals[name]).mesh) if name in book.signals
                       else [] for name in self.workers],
            "micro_batches": self.micro_batches, "schedule": self.schedule,
            "ideal_bubble": bubble(len(self.workers), self.micro_batches, self.schedule,
                                   self.virtual)}

    def evaluate(self, inputs: Any, targets: Any) -> Tensor:
        """The mean loss of the batch, forward only (no graph is kept)."""
        losses = []
        with no_grad():
            for x, y in zip(_cut(inputs, self.micro_batches), _cut(targets, self.micro_batches)):
                for s in range(len(self.stages)):
                    x = self._forward(s, x if s == 0 else signals.tensor(x, self.signals[s]), y)
                losses.append(x)
        return sum(losses[1:], losses[0]) / self.micro_batches

    def _forward(self, s: int, x: Any, y: Any) -> Tensor:
        """Stage s on its input (the first stage's placed there by its signal); the last stage
        gets the targets there too and returns the loss. What crosses a stage
        boundary is placed by the signal of the stage it goes to (a transfer asked for) before
        that stage's scope makes its ops run there."""
        here = self.signals[s]
        if s == 0:
            x = signals.tensor(x, here)
        last = s == len(self.stages) - 1
        y = signals.tensor(y, here) if last else None
        with signals.context(here):
            return self.stages[s](x, y) if last else self.stages[s](x)


def _cut(x: Any, m: int) -> list:
    """m equal micro-batches along dim 0 (equal, so that the mean of their mean losses is the
    batch's)."""
    n = x.shape[0]
    if n % m:
        raise ValueError(f"a batch of {n} does not cut into {m} equal micro-batches")
    return [x[j * (n // m):(j + 1) * (n // m)] for j in range(m)]
