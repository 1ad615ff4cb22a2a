"""CUDA graphs of replayed steps (worker/graphs.py): from the second replay on, a step's program
is launched as one graph per call. On GPU workers these tests capture real CUDA graphs; on CPU
workers the stand-in backend (GTMPI_CUDA_GRAPHS=emulate) runs the same path with the capture
stubbed (static inputs, outputs handed out from fixed storage, copies of outputs still held,
random ops seeded per launch, every member capturing together or none). Either way a graphed
step must give the numbers of the same step replayed op by op, bit for bit."""
from __future__ import annotations

import io

import pytest
import torch

import gtmpi
from conftest import HOME_DEVICE, UNDER_MPI
from gtmpi.client.runtime import runtime
from gtmpi.worker import graphs
from test_replay import (WORKERS, _train, data_parallel, pipeline_run, spread,
                         tensor_parallel_run)

GRAPHS = "1" if HOME_DEVICE.type == "cuda" else "emulate"


def _launches() -> dict[int, int]:
    return {r: s["graph_launches"] for r, s in gtmpi.debug.worker_stats().items()}


def _graphed_against_plain(monkeypatch, layout=None, steps: int = 7):
    """The tiny GPT's losses, last gradients and last step's collectives, replayed op by op and
    as graphs; and the graph launches per worker."""
    place, put = layout() if layout is not None else (None, lambda x, y: (gtmpi.tensor(x),
                                                                           gtmpi.tensor(y)))
    gtmpi.debug.strict_placement()
    # the replayable step's graphs alone: what runs around it is not replayed on its own
    auto = runtime().dispatcher.repeats is not None
    gtmpi.debug.auto_replay(False)
    try:
        monkeypatch.setenv("GTMPI_CUDA_GRAPHS", "0")
        plain = _train(True, place, put, steps=steps)
        monkeypatch.setenv("GTMPI_CUDA_GRAPHS", GRAPHS)
        before = _launches()
        graphed = _train(True, place, put, steps=steps)
        launched = {r: n - before[r] for r, n in _launches().items()}
    finally:
        gtmpi.debug.strict_placement(False)
        gtmpi.debug.auto_replay(auto)
    assert graphed[0] == plain[0]  # bit for bit
    for key, grad in plain[1].items():
        assert torch.equal(graphed[1][key], grad), key
    assert graphed[2] == plain[2]  # the same collectives and transfers, counted per launch
    return graphed, launched


def test_a_graphed_step_gives_the_numbers_of_plain_replay(monkeypatch):
    _, launched = _graphed_against_plain(monkeypatch)
    # calls: as written, recorded, replayed, captured (and launched), then 3 launches
    assert launched[WORKERS[0]] == 4, launched


@spread
@pytest.mark.parametrize("layout", [data_parallel, tensor_parallel_run,
                                    lambda: pipeline_run("1f1b")], ids=["dp", "tp", "pp"])
def test_graphed_parallel_steps_give_the_numbers_of_plain_replay(monkeypatch, layout):
    _, launched = _graphed_against_plain(monkeypatch, layout)
    taking_part = [r for r, n in launched.items() if n]
    assert taking_part and all(launched[r] == 4 for r in taking_part), launched
    assert len(taking_part) >= 2


def test_outputs_held_across_launches_keep_their_values(monkeypatch):
    monkeypatch.setenv("GTMPI_CUDA_GRAPHS", GRAPHS)
    w = gtmpi.ones(3, requires_grad=True)

    @gtmpi.replayable
    def step(x):
        loss = (x * w).sum()
        loss.backward()
        return loss, x * 2

    kept, views = [], []
    for i in range(7):
        w.grad = None
        loss, doubled = step(gtmpi.full((3,), float(i)))
        kept.append((loss, doubled))
        views.append(doubled.view(3, 1))  # made after the launch, of its output's storage
    assert [loss.item() for loss, _ in kept] == [3.0 * i for i in range(7)]
    assert [d.tolist() for _, d in kept] == [[2.0 * i] * 3 for i in range(7)]
    assert [v.tolist() for v in views] == [[[2.0 * i]] * 3 for i in range(7)]
    assert w.grad.tolist() == [6.0] * 3
    assert step.replays == 5


def test_a_graph_never_writes_over_another_graphs_outputs_still_held(monkeypatch):
    """A worker's graphs share one memory pool, so one graph's scratch (its temporaries, free
    once it ends) may hold the outputs of a graph captured after it; outputs still held when
    the first launches again keep their values."""
    monkeypatch.setenv("GTMPI_CUDA_GRAPHS", GRAPHS)
    w = gtmpi.ones(512, 512)

    @gtmpi.replayable
    def scratchy(x):
        return ((w * x).exp() * 2 + 1).sum()  # temporaries of w's size, one number out

    @gtmpi.replayable
    def big(x):
        return w * x  # w's size, made where scratchy's temporaries were

    held = []
    for i in range(8):
        assert scratchy(gtmpi.zeros(1)).item() == 3 * 512 * 512
        held.append(big(gtmpi.full((1,), float(i))))
    assert [h.sum().item() for h in held] == [512.0 * 512 * i for i in range(8)]
    assert scratchy.replays == big.replays == 6


def test_results_read_calls_later_and_changed_in_place_read_right(monkeypatch):
    """A training loop's reads: each call's result read two calls later (on a GPU worker the
    read waits only for the call that made it, not for the calls queued since), one changed
    in place before its read, one through a view of it."""
    monkeypatch.setenv("GTMPI_CUDA_GRAPHS", GRAPHS)
    w = gtmpi.ones(64, 64)

    @gtmpi.replayable
    def step(x):
        y = x @ w
        for _ in range(20):  # GPU work enough to be still queued when the read comes
            y = (y @ w) / 64
        return y.sum(), y[0, :2]

    pending, read = [], []
    for i in range(8):
        pending.append(step(gtmpi.full((64, 64), float(i))))
        if i == 5:
            pending[-1][0].mul_(10)  # in place, after the call, before the read
        if i == 6:
            pending[-1][1].view(2, 1).add_(1)  # in place through a view
        if len(pending) > 2:
            total, head = pending.pop(0)
            read.append((total.item(), head.tolist()))
    read += [(t.item(), h.tolist()) for t, h in pending]
    expect = [(float(i) * 64 * 64 * 64, [float(i) * 64] * 2) for i in range(8)]
    expect[5] = (expect[5][0] * 10, expect[5][1])
    expect[6] = (expect[6][0], [v + 1 for v in expect[6][1]])
    assert read == expect


def test_a_worker_that_cannot_capture_makes_every_one_replay_op_by_op(monkeypatch):
    if HOME_DEVICE.type == "cuda":
        pytest.skip("an index out of range is a device-side assert on a GPU")
    monkeypatch.setenv("GTMPI_CUDA_GRAPHS", GRAPHS)
    broken = gtmpi.ones(2, device="cuda")[gtmpi.tensor([0, 5])]  # fails on its worker: out of range

    @gtmpi.replayable
    def f(x):
        return x + broken

    x = gtmpi.ones(2)
    results = [f(x) for _ in range(5)]
    for r in results:
        with pytest.raises(gtmpi.WorkerError, match="index"):
            r.tolist()
    notes = gtmpi.debug.graph_notes()
    note = next(v for k, v in notes.items() if k.startswith("test_a_worker_that_cannot_capture"))
    assert note.startswith("replayed op by op, no CUDA graph: worker rank") and "failed" in note
    out = io.StringIO()
    gtmpi.debug.explain(out)
    assert "no CUDA graph" in out.getvalue()
    assert (x + 1).tolist() == [2.0, 2.0]  # the session goes on


def test_graphs_on_cpu_workers_say_why_there_are_none(monkeypatch):
    if HOME_DEVICE.type == "cuda":
        pytest.skip("GPU workers capture")
    monkeypatch.setenv("GTMPI_CUDA_GRAPHS", "1")
    f = gtmpi.replayable(lambda x: x * 3)
    x = gtmpi.ones(2)
    assert [f(x).tolist() for _ in range(5)] == [[3.0, 3.0]] * 5
    note = next(v for k, v in gtmpi.debug.graph_notes().items() if k.startswith("test_graphs_on_cpu_workers"))
    assert note.endswith("the worker runs on the cpu"), note


def test_a_run_whose_capture_failed_is_not_captured_again_at_other_sizes(monkeypatch):
    """A decoding loop's sampling repeats a token longer each time: a repeated run per
    length. Once one of them failed to capture (here: CPU workers, which have no graphs), the
    runs of the same ops at other lengths are not captured only to fail again, each a round
    trip to the worker; they replay op by op, say why, and draw what they draw as written."""
    if HOME_DEVICE.type == "cuda":
        pytest.skip("GPU workers capture")
    from test_capture import _Decoder

    def sample(model) -> torch.Tensor:
        # a temperature: ops of this test's own, whose runs no earlier test made
        gtmpi.manual_seed(5)
        idx = gtmpi.zeros(1, 1, dtype=torch.long)
        with gtmpi.no_grad():
            for _ in range(11):
                probs = gtmpi.nn.functional.softmax(model(idx)[:, -1, :] / 0.7, dim=-1)
                idx = gtmpi.cat((idx, gtmpi.multinomial(probs, num_samples=1)), dim=1)
        return idx.cpu_torch()

    # a fresh memory of repeated runs and of their refusals: earlier tests' (PROGRAMS_MAX
    # programs at most) are not this test's
    gtmpi.debug.auto_replay(True)
    d = runtime().dispatcher
    if d.placer.active:  # an earlier test opened a signal's scope or placed a tensor
        if UNDER_MPI:  # on both workers, maybe: runs are not held then
            pytest.skip("runs are held only while one worker holds the tensors")
        monkeypatch.setattr(d.placer, "active", False)  # one worker holds everything
    monkeypatch.setattr(d, "_refused_ops", {})
    gtmpi.manual_seed(0)
    model = _Decoder()
    monkeypatch.setenv("GTMPI_CAPTURE", "0")
    written = sample(model)
    monkeypatch.setenv("GTMPI_CAPTURE", "1")
    monkeypatch.setenv("GTMPI_CUDA_GRAPHS", "1")
    asked = []
    commit = type(d)._commit
    monkeypatch.setattr(type(d), "_commit",
                        lambda self, program, state: (asked.append(program.key),
                                                      commit(self, program, state))[1])
    for _ in range(3):
        assert torch.equal(sample(model), written)
    assert len(asked) == 1, asked
    notes = [v for k, v in gtmpi.debug.graph_notes().items() if k.startswith("repeated run")]
    assert any(v.endswith("the worker runs on the cpu (a run of the same ops before)")
               for v in notes), notes


@pytest.mark.parametrize("graphs", ["0", GRAPHS])
def test_random_ops_in_a_replayed_step_draw_what_they_draw_as_written(monkeypatch, graphs):
    """Dropout (nn.Dropout and attention's), randn and normal_ inside a replayed, captured and
    launched step: the numbers of the same calls run as written, from the same seed."""
    monkeypatch.setenv("GTMPI_CUDA_GRAPHS", graphs)
    nn, F = gtmpi.nn, gtmpi.nn.functional

    def run(replay: bool) -> list[list[float]]:
        gtmpi.manual_seed(7)
        lin = nn.Linear(8, 8)  # drawn from torch's CPU generator: the same in both runs
        drop = nn.Dropout(0.5)

        def step(x):
            h = drop(lin(x))
            q = h.view(1, 2, 4, 4)
            a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
            noise = gtmpi.randn(4, 8, device="cuda") + \
                gtmpi.zeros(4, 8, device="cuda").normal_(0.0, 2.0)
            loss = (a.reshape(4, 8) + noise).square().sum()
            loss.backward()
            return loss

        f = gtmpi.replayable(step) if replay else step
        x = gtmpi.tensor(torch.arange(32, dtype=torch.float32).reshape(4, 8) / 32,
                         device="cuda")  # on the workers: the written run's draws are theirs
        out = []
        for _ in range(6):
            lin.zero_grad()
            loss = f(x)
            out.append([loss.item(), *lin.weight.grad.reshape(-1)[:4].tolist()])
        return out

    written, replayed = run(False), run(True)
    assert replayed == written
    assert len({r[0] for r in written}) == 6  # each call drew afresh


def _graph_of(outputs: dict, scratch=(), kept=()) -> "graphs.Captured":
    """A captured program as the worker keeps it, over CPU tensors: its handle's pool blocks
    are what a CUDA capture reads from the allocator."""
    from types import SimpleNamespace
    captured = graphs.Captured(SimpleNamespace(scratch=list(scratch), kept=list(kept)), {}, [],
                               {}, 1)
    captured.set_outputs(dict(outputs), tuple(outputs))
    return captured


def _block(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def test_outputs_in_another_graphs_scratch_are_set_aside_while_it_runs():
    """Kept, alone: an output captured into an earlier graph's scratch is that graph's risk;
    held when it launches, it is copied aside and put back; not held, it costs nothing; an
    input that is a graph's output is read where it lies, any other is copied."""
    kept = graphs.Kept()
    x = torch.arange(8.0)
    start, end = _block(x)
    first = _graph_of({1: torch.zeros(2)}, scratch=[(start - 512, end + 512)])
    kept.add(1, first)
    kept.launched(first)
    later = _graph_of({2: x}, kept=[(start, end)])
    kept.add(2, later)
    kept.launched(later)
    assert first.risks == [(later, frozenset({start}), {}, False)] and later.risks == []
    later.handed = [7]  # its last launch's output went out under id 7
    assert kept.clear_way(first, {7: x.clone()}) == []  # 7 is another tensor now: not held
    aside = kept.clear_way(first, {7: x})
    assert [storage.data_ptr() for storage, _ in aside] == [start]
    x.zero_()  # what the launch writes in its scratch
    for storage, saved in aside:
        storage.copy_(saved)
    assert x.tolist() == list(range(8))
    assert kept.bind(x) == (x, True)
    other = torch.ones(3)
    copy, same = kept.bind(other)
    assert not same and copy is not other and torch.equal(copy, other)
    kept.pop(2)
    assert first.risks == [] and kept.bind(x)[1] is False


@pytest.mark.parametrize("aside", [False, True], ids=["unknown", "set-aside"])
def test_a_held_autograd_record_in_a_graphs_scratch(aside):
    """What a record saved for its backward, in an earlier graph's scratch while the record is
    held: that graph runs op by op, or (GTMPI_GRAPH_SAVED_ASIDE=1) the record's saved tensors,
    found on its backward nodes, are set aside and put back like outputs."""
    from gtmpi.ops.table import Graph
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    out = torch.nn.functional.layer_norm(x, (8,), w)
    record = Graph(out, [x, w])
    mean = out.grad_fn._saved_result1  # saved by torch's layer norm: neither output nor leaf
    assert graphs.saved_storages(record).keys() >= {_block(mean)[0], _block(x)[0], _block(out)[0]}
    kept = graphs.Kept(saved_aside=aside)
    first = _graph_of({1: torch.zeros(2)}, scratch=[_block(mean)])
    kept.add(1, first)
    kept.launched(first)
    later = _graph_of({2: torch.zeros(1), 3: record}, kept=[_block(mean)])
    kept.add(2, later)
    kept.launched(later)
    later.handed = [8, 9]
    held = {8: torch.zeros(1), 9: record}
    if not aside:
        assert first.risks == [(later, frozenset(), {}, True)]
        assert first.unlaunchable(held, ()) == graphs.RECORD_IN_SCRATCH
        assert first.unlaunchable({8: torch.zeros(1)}, ()) is None  # the record is gone
        return
    assert first.unlaunchable(held, ()) is None
    before = mean.clone()
    moved = kept.clear_way(first, held)
    assert [s.data_ptr() for s, _ in moved] == [_block(mean)[0]]
    mean.zero_()  # the launch writes its scratch
    for storage, copy in moved:
        storage.copy_(copy)
    assert torch.equal(mean, before)
    assert kept.clear_way(first, {8: torch.zeros(1)}) == []  # not held: nothing to move


def test_a_replays_bound_input_is_not_kept_by_its_gpu_event():
    """A GPU worker notes when a replay's results are final (Executor.ready); binding one as
    the next program's input must not leave a note under the recorded id: it kept every
    iteration's activations alive for good (about 1 GB of nanoGPT's on one H200)."""
    from gtmpi.transport.local import LocalLink
    from gtmpi.worker.executor import Executor
    ex = Executor(1, torch.device("cpu"), LocalLink())
    ex.run([("zeros", 1, ((4,), torch.float32), 0, {})])
    ex.ready[1] = (None, ex.env[1])  # as a GPU worker notes a replay's result
    ex.run([("program", None, (7, [("neg", 20, (10,), 1, None)]), 0, None),
            ("replay", None, (7, ((1, 10),), ((20, 2),), "plain", None), 0, None)])
    assert torch.equal(ex.env[2], -torch.zeros(4)) and 10 not in ex.env
    assert set(ex.ready) == {1}


@pytest.mark.parametrize("capture", ["0", "1"])
def test_models_trained_one_after_another_get_the_numbers_of_the_first(monkeypatch, capture):
    """Each new model's optimizer state comes out of the graph of its lazy zeros, the same
    tensor objects every time: what AdamW notes on them (their step counts) must not follow
    them into the next model's state (it did: the fifth model's first update used the fourth's
    last bias corrections)."""
    from test_capture import _loop
    monkeypatch.setenv("GTMPI_CUDA_GRAPHS", GRAPHS)
    first = None
    for _ in range(5):
        losses, weights, _, _ = _loop(capture, monkeypatch,
                                      lambda p: gtmpi.optim.AdamW(p, lr=1e-2), 5)
        first = first or (losses, weights)
        assert losses == first[0]
        for key, w in first[1].items():
            assert torch.equal(weights[key], w), key
