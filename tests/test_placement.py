"""Sharding by signals and configs: each pattern equal to the same program on one worker, the
placements of the results, and the collectives that ran; bad configs and misuse."""
from __future__ import annotations

import contextlib
import json
import io
import os
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import gtmpi
import gtmpi.nn as nn
import gtmpi.nn.functional as F
from conftest import assert_same, line_of, mpiexec, run_job
from gtmpi.placement.rules import PlacementError
from gtmpi.signals.config import ConfigError, load, parse

ROOT = Path(__file__).resolve().parent.parent
WORKERS = sorted(gtmpi.info()["workers"])
spread = pytest.mark.skipif(len(WORKERS) < 2, reason="needs 2 or more workers (the MPI suite)")

CONFIG = {
    "data": {"shard": {"axis": 0, "workers": [0, 1]}},
    "weights": {"shard": {"workers": [0, 1], "replicated": True}},
    "col": {"shard": {"axis": 0, "workers": [0, 1]}},
    "row": {"shard": {"axis": 1, "workers": [0, 1]}},
    "stage0": {"shard": {"workers": [0]}},
    "stage1": {"shard": {"workers": [1]}},
}


@pytest.fixture(scope="module", autouse=True)
def config():
    if len(WORKERS) >= 2:
        gtmpi.load_config(CONFIG)


def collectives(field: int = 0) -> dict[str, int]:
    """Collectives run so far, summed over workers, by kind (count; field=1: bytes)."""
    total: dict[str, int] = {}
    for s in gtmpi.debug.worker_stats().values():
        for kind, counts in s["collectives"].items():
            total[kind] = total.get(kind, 0) + counts[field]
    return total


def ran_since(before: dict[str, int], field: int = 0) -> dict[str, int]:
    now = collectives(field)
    return {k: now[k] - before.get(k, 0) for k in now if now[k] != before.get(k, 0)}


def waits_in_one_order(trace) -> int:
    """Check that the steps where workers wait for each other (making a group: all workers,
    as NCCL splits the world's communicator; the n-th collective in a group: its members; the
    n-th transfer between two workers: both) fit one order that every worker's own order
    agrees with. Where none does, NCCL deadlocks (gloo may not: its groups are made by their
    members alone). Returns the number of such steps."""
    import graphlib
    from gtmpi.recording.events import Kind
    after: dict[tuple, set] = {}
    for rank, events in trace.events.items():
        seen: dict = {}
        last = None
        for e in events:
            name = trace.name(int(e["name"]))
            if e["kind"] == Kind.COLLECTIVE:
                key = trace.name(int(e["detail"]))
            elif e["kind"] == Kind.CONTROL and name == "new_group":
                key = "new group"
            elif e["kind"] == Kind.TRANSFER and name in ("send", "recv"):
                key = tuple(sorted((rank, int(e["peer"]))))
            else:
                continue
            step = (key, seen.setdefault(key, 0))
            seen[key] += 1
            after.setdefault(step, set()).update([last] if last else [])
            last = step
    try:
        graphlib.TopologicalSorter(after).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"workers wait for each other in a cycle: {e.args[1]}") from None
    return len(after)


def where(t) -> str:
    d = gtmpi.debug.placement(t)
    return f"{d['type']}@{d['mesh']}"


# configs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("config, message", [
    ({"s": {"shard": {"axis": 0, "workers": [0, 1]}, "sharding": 1}}, "signal 's', key 'sharding': unknown key"),
    ({"s": {"shard": {"axes": 0}}}, "signal 's', key 'shard.axes': unknown key"),
    ({"s": {"shard": {"workers": [0, 0], "axis": 0}}}, "key 'shard.workers'"),
    ({"s": {"shard": {"workers": [0, 1]}}}, "key 'shard.axis': several workers need an axis"),
    ({"s": {"shard": {"workers": [0, 1], "axis": 0, "replicated": True}}}, "key 'shard.replicated'"),
    ({"s": {"shard": {"workers": [0], "axis": "0"}}}, "key 'shard.axis': expected an integer"),
    ({"s": {"backward": 3}}, "key 'backward'"),
    ({"s": 5}, "signal 's': expected a mapping"),
])
def test_bad_configs_name_file_signal_and_key(config, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse(config, "<dict>")


@pytest.mark.parametrize("body, message", [
    ({"mesh": {"dp": 2, "tp": 0}, "placement": {"dp": "R", "tp": "R"}}, "key 'mesh'"),
    ({"mesh": {"dp": 2, "tp": 2}, "placement": {"dp": "R"}}, "key 'placement': expected one of"),
    ({"mesh": {"dp": 2, "tp": 2}, "placement": {"dp": "R", "tp": "Q"}}, "key 'placement.tp'"),
    ({"mesh": {"dp": 2, "tp": 2}, "placement": {"dp": "S(0)", "tp": "S(0)"}},
     "key 'placement': two axes shard the same dim"),
    ({"mesh": {"dp": 2, "tp": 2}, "placement": {"dp": "R", "tp": "R"},
      "shard": {"workers": [0, 1, 2]}}, "key 'shard.workers': a mesh of 4 needs 4"),
    ({"mesh": {"dp": 2}, "placement": {"dp": "R"}, "shard": {"axis": 0}}, "key 'shard.axis'"),
    ({"mesh": {"dp": 2}, "placement": {"dp": "R"}, "compile": "yes"}, "key 'compile'"),
    ({"mesh": {"dp": 2}, "placement": {"dp": "R"}, "backward": 3}, "key 'backward'"),
    ({"mesh": {"dp": 2}, "placement": {"dp": "R"}, "shard": {"workers": [[0], 1]}},
     "key 'shard.workers'"),
])
def test_bad_named_meshes(body, message):
    with pytest.raises(ConfigError, match=rf"<dict>: signal 'm', {message}"):
        parse({"m": body}, "<dict>")


def test_named_mesh_config():
    (s,) = parse({"m": {"mesh": {"dp": 2, "tp": 3}, "placement": {"dp": "S(0)", "tp": "P"}}},
                 "<dict>").values()
    assert (s.grid, s.axes, s.axis_names, s.workers) == \
        ((2, 3), (("S", 0), ("P", 0)), ("dp", "tp"), tuple(range(6)))


def test_yaml_configs_load_and_bad_files_are_named(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("data:\n  shard:\n    axis: 0\n    workers: [0, 1]\n  backward: data\n")
    (s,) = load(str(good)).values()
    assert (s.name, s.axis, s.workers, s.backward, s.source) == ("data", 0, (0, 1), "data", str(good))
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  shard: {axis: 0\n")
    with pytest.raises(ConfigError, match=rf"{bad}: not valid YAML at line \d"):
        load(str(bad))
    with pytest.raises(ConfigError, match="cannot read the config"):
        load(str(tmp_path / "missing.yaml"))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("data:\n  shard: {axis: 0}\n  bakward: x\n")
    with pytest.raises(ConfigError, match=rf"{unknown}: signal 'data', key 'bakward': unknown key"):
        load(str(unknown))


def test_worker_out_of_range_for_the_job():
    n = len(WORKERS)
    with pytest.raises(ConfigError, match=rf"signal 'far', key 'shard.workers': worker {n} is out "
                                          rf"of range: this job has {n} worker"):
        gtmpi.load_config({"far": {"shard": {"workers": [0, n], "axis": 0}}})


@pytest.mark.parametrize("workers", [[0], [0, 1]])
def test_an_axis_out_of_range_is_refused_on_one_worker_as_on_two(workers):
    """A config tried on one machine fails there, not first on the cluster."""
    if max(workers) >= len(WORKERS):
        pytest.skip("needs 2 workers (the MPI suite)")
    gtmpi.load_config({"far_axis": {"shard": {"axis": 5, "workers": workers}}})
    with pytest.raises(ConfigError, match=r"axis 5 is out of range for a tensor of shape \[2, 3\]"):
        gtmpi.signal.tensor(torch.ones(2, 3), "far_axis")
    with pytest.raises(ConfigError, match="axis 5 is out of range"):
        with gtmpi.signal.context("far_axis"):
            gtmpi.ones(2, 3)


def test_a_signal_missing_from_the_config_is_a_no_op_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with gtmpi.signal.context("nowhere"):
                x = gtmpi.ones(4, 4)
        y = gtmpi.signal.tensor(x, "nowhere")
    assert [str(w.message) for w in caught] == \
        ["gtmpi: signal 'nowhere' is not in the config; its scope changes nothing"]
    assert where(y) == f"R@[{WORKERS[0]}]"
    assert_same(y + 1, torch.full((4, 4), 2.0))


@pytest.mark.parametrize("how", ["context", "enter", "tensor"])
def test_a_missing_signals_warning_names_the_programs_line(how):
    """Not gtmpi's own line (signals/__init__.py), whichever way the signal is named."""
    name = f"nowhere_{how}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "context":
            with gtmpi.signal.context(name): line = sys._getframe().f_lineno  # noqa: E701
        elif how == "enter":
            gtmpi.signal.enter(name); line = sys._getframe().f_lineno  # noqa: E702
            gtmpi.signal.exit(name)
        else:
            gtmpi.signal.tensor(gtmpi.ones(2), name); line = sys._getframe().f_lineno  # noqa: E702
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


def test_enter_exit_must_match():
    with pytest.raises(RuntimeError, match="does not match the innermost open signal"):
        gtmpi.signal.exit("never-entered")


# patterns ---------------------------------------------------------------------------------

@spread
def test_axis_out_of_range_for_the_tensor():
    with pytest.raises(ConfigError, match=r"<dict>: signal 'row', key 'shard.axis': axis 1 is out "
                                          r"of range for a tensor of shape \[4\]"):
        with gtmpi.signal.context("row"):
            gtmpi.zeros(4)


@spread
def test_sharded_tensors_read_whole_even_uneven(gen):
    host = torch.randn(5, 3, generator=gen)
    x = gtmpi.signal.tensor(host, "data")
    assert gtmpi.debug.placement(x) == {"mesh": WORKERS[:2], "grid": [2], "type": "S(0)",
                                        "shards": {WORKERS[0]: (3, 3), WORKERS[1]: (2, 3)}}
    assert_same(x, host)
    with gtmpi.signal.context("data"):
        r = gtmpi.randn(7, 2)
    gtmpi.manual_seed(0)  # random values do not depend on the placement
    assert where(r) == f"S(0)@{WORKERS[:2]}"


@spread
def test_reshards_move_the_fewest_bytes(gen):
    host = torch.randn(5, 7, generator=gen)
    x = gtmpi.signal.tensor(host, "data")
    before = collectives()
    y = gtmpi.signal.tensor(x, "row")  # S(0) -> S(1): each worker sends the other its part
    assert ran_since(before) == {"all_to_all": 2}
    assert where(y) == f"S(1)@{WORKERS[:2]}"
    assert_same(y, host)
    partial = x.sum(0, keepdim=True) * 1.0
    assert where(partial) == f"P@{WORKERS[:2]}"
    before = collectives()
    z = gtmpi.signal.tensor(partial, "row")  # P -> S(1): a reduce-scatter (gloo: an all-reduce
    assert ran_since(before) == {"reduce_scatter": 2}  # counted as the reduce-scatter it is)
    assert_same(z, host.sum(0, keepdim=True), rtol=1e-5, atol=1e-6)


@spread
def test_invariant_varying_and_partial_from_configs(gen):
    one = {"dp": 2}
    gtmpi.load_config({name: {"mesh": one, "placement": {"dp": kind}}
                       for name, kind in (("inv", "I"), ("var", "V"), ("part", "P"))})
    with gtmpi.signal.context("inv"):
        a = gtmpi.ones(3)
    b = a * 2.0 + 1.0
    assert where(a) == where(b) == f"I@{WORKERS[:2]}"  # invariant in, invariant out
    assert_same(b, torch.full((3,), 3.0))
    with gtmpi.signal.context("part"):
        z = gtmpi.ones(3)  # the first member holds the value, the other zeros
    assert where(z) == f"P@{WORKERS[:2]}"
    assert_same(z, torch.ones(3))
    with gtmpi.signal.context("var"):
        r = gtmpi.randn(64)
    s = r * 2.0 + 1.0
    assert where(r) == where(s) == f"V@{WORKERS[:2]}"
    with pytest.raises(PlacementError, match="varying .V. across workers"):
        r.numpy()
    x = gtmpi.signal.tensor(torch.randn(64, generator=gen), "data")
    with pytest.raises(PlacementError, match="a varying .V. operand cannot meet S"):
        r + x
    total = gtmpi.signal.tensor(r, "part").numpy()        # r0 + r1
    squares = gtmpi.signal.tensor(r * r, "part").numpy()  # r0² + r1²
    assert not np.allclose(squares, total ** 2 / 2)  # the members drew different numbers
    assert_same(gtmpi.signal.tensor(r * 0.0 + 1.0, "part"), torch.full((64,), 2.0))


@spread
def test_nested_signals_inner_wins_outer_returns():
    with gtmpi.signal.context("weights"):
        a = gtmpi.ones(4, 2)
        gtmpi.signal.enter("data")
        b = gtmpi.ones(4, 2)
        gtmpi.signal.exit("data")
        c = gtmpi.ones(4, 2)
    d = gtmpi.ones(4, 2)
    assert [where(t) for t in (a, b, c, d)] == [f"R@{WORKERS[:2]}", f"S(0)@{WORKERS[:2]}",
                                               f"R@{WORKERS[:2]}", f"R@[{WORKERS[0]}]"]


@spread
def test_backward_runs_on_the_named_signals_workers(gen):
    w_host, x_host = torch.randn(3, 4, generator=gen), torch.randn(5, 4, generator=gen)
    with gtmpi.signal.context("stage0", backward="stage1"):
        w = gtmpi.tensor(w_host, requires_grad=True)
        loss = F.linear(gtmpi.tensor(x_host), w).tanh().sum()
    assert where(loss) == f"R@[{WORKERS[0]}]"
    loss.backward()
    assert where(w.grad) == f"R@[{WORKERS[1]}]"  # the gradient ops ran on stage1's worker
    ref = w_host.clone().requires_grad_()
    torch.nn.functional.linear(x_host, ref).tanh().sum().backward()
    assert_same(w.grad, ref.grad, rtol=1e-5, atol=1e-6)


@spread
def test_sharded_reductions_and_shape_ops(gen):
    host = torch.randn(6, 4, generator=gen)
    x = gtmpi.signal.tensor(host, "data")
    before = collectives()
    total = x.sum()
    assert where(total) == f"P@{WORKERS[:2]}"
    assert_same(total, host.sum(), rtol=1e-5, atol=1e-5)
    by_row = x.sum(1)
    assert where(by_row) == f"S(0)@{WORKERS[:2]}"
    assert_same(by_row, host.sum(1), rtol=1e-5, atol=1e-5)
    assert_same(x.sum(0), host.sum(0), rtol=1e-5, atol=1e-5)
    assert_same(x.mean(0), host.mean(0), rtol=1e-5, atol=1e-5)
    assert_same(x.amax(0), host.amax(0))
    assert_same(x.softmax(1), host.softmax(1))
    assert_same(x.softmax(0), host.softmax(0))
    t = x.transpose(0, 1)
    assert where(t) == f"S(1)@{WORKERS[:2]}"
    assert_same(t, host.T)
    assert_same(x.reshape(3, 8), host.reshape(3, 8))
    assert_same(x.reshape(-1), host.reshape(-1))
    assert_same(x[1:5, ::2], host[1:5, ::2])
    assert_same((x * 2.0 + 1.0).relu(), (host * 2 + 1).relu())
    ran = ran_since(before)
    assert ran.get("all_reduce", 0) >= 1 and ran.get("all_gather", 0) >= 1


def mlp_params(gen):
    return [torch.randn(16, 4, generator=gen) * 0.3, torch.randn(16, generator=gen) * 0.1,
            torch.randn(3, 16, generator=gen) * 0.3, torch.randn(3, generator=gen) * 0.1]


@spread
@pytest.mark.parametrize("optimizer, kw", [("AdamW", {"lr": 0.05}), ("SGD", {"lr": 0.1}),
                                           ("SGD", {"lr": 0.1, "momentum": 0.9})])
def test_data_parallel_training_equals_one_worker(gen, optimizer, kw):
    """Batch sharded, parameters replicated, gradients all-reduced, replicas identical; with
    SGD (no optimizer state at all) and with momentum as with Adam."""
    init = mlp_params(gen)
    xs = [torch.randn(8, 4, generator=gen) for _ in range(3)]
    ys = [torch.randint(0, 3, (8,), generator=gen) for _ in range(3)]

    def train(sharded: bool):
        with gtmpi.signal.context("weights") if sharded else contextlib.nullcontext():
            params = [gtmpi.tensor(p, requires_grad=True) for p in init]
        opt = getattr(gtmpi.optim, optimizer)(params, **kw)
        losses = []
        for x, y in zip(xs, ys):
            if sharded:
                x, y = gtmpi.signal.tensor(x, "data"), gtmpi.signal.tensor(y, "data")
            else:
                x, y = gtmpi.tensor(x), gtmpi.tensor(y)
            opt.zero_grad()
            h = F.linear(x, params[0], params[1]).relu()
            loss = F.cross_entropy(F.linear(h, params[2], params[3]), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, params

    want_losses, want = train(False)
    before, before_bytes = collectives(), collectives(1)
    losses, params = train(True)
    ran, moved = ran_since(before), ran_since(before_bytes, 1)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for p, w in zip(params, want):
        assert where(p) == f"R@{WORKERS[:2]}"
        assert_same(p.detach(), w.detach().cpu_torch(), rtol=1e-5, atol=1e-6)
        halves = gtmpi.signal.tensor(p.detach(), "data")  # each worker's rows from its own copy
        assert_same(halves, w.detach().cpu_torch(), rtol=1e-5, atol=1e-6)
    # per step, on each of the 2 workers: one all-reduce of all four gradients as one bucket
    # (they come out as partial sums) and two for the loss (the sum of the rows' losses, the
    # count of rows); nothing is gathered: the logits stay split
    assert ran["all_reduce"] == 3 * (1 + 2) * 2 and "all_gather" not in ran
    assert moved["all_reduce"] == 3 * 2 * (sum(p.numel() for p in init) * 4 + 2 * 4)


def megatron_mlp(sharded: bool, x_host: torch.Tensor, params: tuple) -> tuple:
    """The input and the MLP's weights, as leaves: Megatron's signals if ``sharded``."""
    def make(t, signal):
        if not sharded:
            return gtmpi.tensor(t, requires_grad=True)
        with gtmpi.signal.context(signal):
            return gtmpi.tensor(t, requires_grad=True)
    w1, b1, w2, b2 = params
    return make(x_host, "weights"), [make(w1, "col"), make(b1, "col"), make(w2, "row"),
                                     make(b2, "weights")]


@spread
def test_tensor_parallel_mlp_one_all_reduce_each_way(gen):
    """Megatron's MLP: column-parallel then row-parallel linear layers."""
    w1, b1, w2, b2 = mlp_params(gen)
    x_host = torch.randn(8, 4, generator=gen)

    def run(sharded: bool):
        x, p = megatron_mlp(sharded, x_host, (w1, b1, w2, b2))
        before = collectives()
        h = F.gelu(F.linear(x, p[0], p[1]))
        y = F.linear(h, p[2]) + p[3]  # a partial sum still: the bias taken as one
        loss = (y * y).mean()
        fwd = ran_since(before)
        loss.backward()
        x_grad = x.grad.numpy()
        return loss, h, p, x_grad, fwd, ran_since(before)

    want = run(False)
    loss, h, p, x_grad, fwd, both = run(True)
    assert where(h) == f"S(1)@{WORKERS[:2]}"
    assert fwd == {"all_reduce": 2}  # one all-reduce (on each of the 2 workers)
    # and one more in backward, the input's gradient; reading x.grad from a replica first
    # agrees that no replica's copy failed (one flag, on each worker)
    assert both == {"all_reduce": 4, "agree": 2}
    assert_same(loss, want[0].cpu_torch(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x_grad, want[3], rtol=1e-4, atol=1e-6)
    assert [where(t.grad) for t in p] == [f"S(0)@{WORKERS[:2]}", f"S(0)@{WORKERS[:2]}",
                                         f"S(1)@{WORKERS[:2]}", f"R@{WORKERS[:2]}"]
    for got, ref in zip(p, want[2]):
        assert_same(got.grad, ref.grad.cpu_torch(), rtol=1e-4, atol=1e-6)


@spread
def test_column_parallel_input_gradient_is_summed_inside_its_kernel(gen, tmp_path):
    """Where a column-parallel layer's input is read by that layer alone, the partial sums of
    its gradient are all-reduced by the gradient kernel itself, started before the weight's
    gradient is computed (Megatron's asynchronous all-reduce): the same collectives and
    numbers as summing them at their first use, and no separate all_reduce_ instruction."""
    from gtmpi.recording import fileformat
    from gtmpi.trace import analysis
    from gtmpi.recording.events import Kind
    w1, b1, w2, b2 = mlp_params(gen)
    x_host = torch.randn(8, 4, generator=gen)
    path = str(tmp_path / "overlap.h5")

    def run(sharded: bool):
        x, p = megatron_mlp(sharded, x_host, (w1, b1, w2, b2))
        before = collectives()
        with gtmpi.signal.context("weights"):
            u = x * 2.0  # read by the first layer only
        y = F.linear(F.gelu(F.linear(u, p[0], p[1])), p[2]) + p[3]
        loss = (y * y).mean()
        if sharded:
            gtmpi.trace.start(path)
        loss.backward()
        x_grad = x.grad.numpy()
        if sharded:
            gtmpi.trace.stop()
        return x_grad, p, ran_since(before)

    want = run(False)
    x_grad, p, ran = run(True)
    assert ran == {"all_reduce": 4, "agree": 2}, ran
    np.testing.assert_allclose(x_grad, want[0], rtol=1e-4, atol=1e-6)
    for got, ref in zip(p, want[1]):
        assert_same(got.grad, ref.grad.cpu_torch(), rtol=1e-4, atol=1e-6)
    trace = fileformat.read(path)
    for rank in WORKERS[:2]:
        events = trace.events[rank]
        names = [trace.name(int(n)) for n in events["name"]]
        assert "all_reduce_" not in names  # the backward moved nothing else
        (grad,) = [e for e, n in zip(events, names) if n == "linear_grad" and e["bytes"]]
        assert grad["bytes"] == 8 * 4 * 4
        assert trace.name(int(grad["detail"])).startswith("all_reduce in group ")
    assert analysis.select(trace.events[WORKERS[0]], (Kind.COLLECTIVE,)).size == 0


@spread
def test_row_parallel_result_is_summed_inside_its_kernel_in_pieces(gen, tmp_path):
    """GTMPI_OVERLAP_CHUNKS=k: a row-parallel layer's partial sum is all-reduced by its own
    kernel, k pieces of rows each summed as soon as it is multiplied (beside the next piece's
    matmul, the seed's overlap): the numbers of summing it after, k all-reduces in its place,
    bias included, and the trace says so at the kernel."""
    from gtmpi.client.runtime import runtime
    from gtmpi.recording import fileformat
    w1, b1, w2, b2 = mlp_params(gen)
    x_host = torch.randn(8, 4, generator=gen)
    path = str(tmp_path / "pieces.h5")
    placer = runtime().dispatcher.placer

    def run(chunks: int):
        placer.chunks = chunks
        try:
            x, p = megatron_mlp(True, x_host, (w1, b1, w2, b2))
            before = collectives()
            if chunks:
                gtmpi.trace.start(path)
            y = F.linear(F.gelu(F.linear(x, p[0], p[1])), p[2], p[3])
            loss = (y * y).mean()
            fwd = ran_since(before)
            loss.backward()
            out = (y.detach().numpy(), x.grad.numpy(), fwd, p)
            if chunks:
                gtmpi.trace.stop()
            return out
        finally:
            placer.chunks = 0

    want = run(0)
    y, x_grad, fwd, p = run(3)
    assert want[2] == {"all_reduce": 2} and fwd == {"all_reduce": 6}, (want[2], fwd)
    np.testing.assert_allclose(y, want[0], rtol=1e-6, atol=1e-7)  # addmm's rounding, by pieces
    np.testing.assert_allclose(x_grad, want[1], rtol=1e-5, atol=1e-6)
    for got, ref in zip(p, want[3]):
        np.testing.assert_allclose(got.grad.numpy(), ref.grad.numpy(), rtol=1e-5, atol=1e-6)
    trace = fileformat.read(path)
    for rank in WORKERS[:2]:
        events = trace.events[rank]
        names = [trace.name(int(n)) for n in events["name"]]
        assert "all_reduce" not in names  # no collective of its own: the kernel ran them
        pieces = [e for e, n in zip(events, names) if n == "linear" and e["bytes"]]
        assert len(pieces) == 1 and pieces[0]["bytes"] == y.nbytes
        assert trace.name(int(pieces[0]["detail"])).endswith(", in 3 pieces")


@spread
def test_pipeline_stages_send_activations_and_gradients(gen):
    w1, b1, w2, b2 = mlp_params(gen)
    x_host = torch.randn(8, 4, generator=gen)

    def run(staged: bool):
        stage = (lambda name: gtmpi.signal.context(name)) if staged else \
            (lambda name: contextlib.nullcontext())
        with stage("stage0"):
            x = gtmpi.tensor(x_host)
            a, b = gtmpi.tensor(w1, requires_grad=True), gtmpi.tensor(b1, requires_grad=True)
            h = F.linear(x, a, b).relu()
        with stage("stage1"):
            c, d = gtmpi.tensor(w2, requires_grad=True), gtmpi.tensor(b2, requires_grad=True)
            y = F.linear(h, c, d)
            loss = (y * y).mean()
        loss.backward()
        return loss, h, [a, b, c, d]

    want = run(False)
    before = collectives()
    loss, h, params = run(True)
    ran = ran_since(before)
    assert where(h) == f"R@[{WORKERS[0]}]" and where(loss) == f"R@[{WORKERS[1]}]"
    assert [where(t) for t in params] == [f"R@[{WORKERS[0]}]"] * 2 + [f"R@[{WORKERS[1]}]"] * 2
    assert ran.get("send", 0) >= 2 and ran["send"] == ran["recv"]  # forward and backward
    assert_same(loss, want[0].cpu_torch(), rtol=1e-5, atol=1e-6)
    for got, ref in zip(params, want[2]):
        assert_same(got.grad, ref.grad.cpu_torch(), rtol=1e-5, atol=1e-6)


# 3 and 4 workers: whole jobs of their own, from the serial suite ---------------------------

MANY = """
    import contextlib, json
    import numpy as np, torch, gtmpi
    import gtmpi.nn.functional as F
    n = len(gtmpi.info()["workers"])
    every = list(range(n))
    gtmpi.load_config({"data": {"shard": {"axis": 0, "workers": every}},
                       "weights": {"shard": {"workers": every, "replicated": True}},
                       "col": {"shard": {"axis": 0, "workers": every}},
                       "row": {"shard": {"axis": 1, "workers": every}}})
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(18, 5, generator=gen), torch.randn(18, generator=gen),
            torch.randn(3, 18, generator=gen), torch.randn(3, generator=gen)]
    x_host, y_host = torch.randn(11, 5, generator=gen), torch.randint(0, 3, (11,), generator=gen)

    def run(places):
        def made(name, t, grad=True):
            with gtmpi.signal.context(name) if name else contextlib.nullcontext():
                return gtmpi.tensor(t, requires_grad=grad)
        p = [made(places.get(f"p{i}"), t) for i, t in enumerate(init)]
        x, y = made(places.get("data"), x_host, False), made(places.get("data"), y_host, False)
        h = F.linear(x, p[0], p[1]).relu()
        loss = F.cross_entropy(F.linear(h, p[2]) + p[3], y)
        loss.backward()
        return [loss.item()] + [float(t.grad.abs().sum().item()) for t in p]

    ref = run({})
    dp = run({"data": "data", **{f"p{i}": "weights" for i in range(4)}})
    tp = run({"data": "weights", "p0": "col", "p1": "col", "p2": "row", "p3": "weights"})
    stats = gtmpi.debug.worker_stats()
    print("RESULT", json.dumps({"ref": ref, "dp": dp, "tp": tp, "workers": n,
          "collectives": {r: s["collectives"] for r, s in stats.items()}}))
"""


@pytest.mark.skipif(len(WORKERS) > 1 or mpiexec() is None,
                    reason="starts its own jobs; run once, from the serial suite")
@pytest.mark.parametrize("workers", [3, 4])
def test_patterns_on_3_and_4_workers(tmp_path, workers):
    import json
    from gtmpi.recording import fileformat
    trace = tmp_path / "many.h5"
    proc, _ = run_job(tmp_path, MANY, 120, n=workers + 1, env={"GTMPI_TRACE": str(trace)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    # something to order (groups, collectives, transfers; the gradients go as one bucket)
    assert waits_in_one_order(fileformat.read(str(trace))) > 5
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["workers"] == workers
    np.testing.assert_allclose(out["dp"], out["ref"], rtol=1e-4)
    np.testing.assert_allclose(out["tp"], out["ref"], rtol=1e-4)
    for rank, kinds in out["collectives"].items():
        assert kinds["all_reduce"][0] > 0, (rank, kinds)  # every worker took part


GRID = """
    import contextlib, json
    import numpy as np, torch, gtmpi
    import gtmpi.nn.functional as F
    grid = {"dp": 2, "tp": 2}
    gtmpi.load_config({
        "act": {"mesh": grid, "placement": {"dp": "S(0)", "tp": "R"}},
        "col": {"mesh": grid, "placement": {"dp": "R", "tp": "S(0)"}},
        "row": {"mesh": grid, "placement": {"dp": "R", "tp": "S(1)"}},
        "rep": {"mesh": grid, "placement": {"dp": "R", "tp": "R"}}})
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(12, 5, generator=gen) * 0.3, torch.randn(12, generator=gen) * 0.1,
            torch.randn(3, 12, generator=gen) * 0.3, torch.randn(3, generator=gen) * 0.1]
    xs = [torch.randn(10, 5, generator=gen) for _ in range(3)]
    ys = [torch.randint(0, 3, (10,), generator=gen) for _ in range(3)]

    def run(places):
        def made(name, t, grad=True):
            with gtmpi.signal.context(name) if name else contextlib.nullcontext():
                return gtmpi.tensor(t, requires_grad=grad)
        p = [made(places.get(f"p{i}"), t) for i, t in enumerate(init)]
        opt = gtmpi.optim.AdamW(p, lr=0.05)
        losses = []
        for x, y in zip(xs, ys):
            x, y = made(places.get("data"), x, False), made(places.get("data"), y, False)
            opt.zero_grad()
            h = F.linear(x, p[0], p[1]).relu()
            loss = F.cross_entropy(F.linear(h, p[2]) + p[3], y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        where = [gtmpi.debug.placement(t)["type"] for t in (h, p[0], p[2])]
        trained = {r: s["collectives"] for r, s in gtmpi.debug.worker_stats().items()}
        return losses, [t.detach().numpy().tolist() for t in p], where, trained

    ref = run({})
    got = run({"data": "act", "p0": "col", "p1": "col", "p2": "row", "p3": "rep"})
    print("RESULT", json.dumps({"ref": ref, "got": got}))
"""


@pytest.mark.skipif(len(WORKERS) > 1 or mpiexec() is None,
                    reason="starts its own jobs; run once, from the serial suite")
def test_dp_by_tp_on_a_named_mesh_of_4_workers(tmp_path):
    import json
    from gtmpi.recording import fileformat
    trace = tmp_path / "grid.h5"
    proc, _ = run_job(tmp_path, GRID, 150, n=5, env={"GTMPI_TRACE": str(trace)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert waits_in_one_order(fileformat.read(str(trace))) > 20
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    (ref_losses, ref_params, _, _), (losses, params, where, trained) = out["ref"], out["got"]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for got, want in zip(params, ref_params):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # activations: batch over dp, hidden units over tp; weights: replicated over dp, split over tp
    assert where == [["S(0)", "S(1)"], ["R", "S(0)"], ["R", "S(1)"]]
    for rank, kinds in trained.items():  # training only sums: nothing is gathered
        assert kinds["all_reduce"][0] > 0 and "all_gather" not in kinds, (rank, kinds)


@spread
def test_traces_show_inserted_collectives(gen, tmp_path):
    from gtmpi.recording import fileformat
    from gtmpi.trace import analysis
    from gtmpi.recording.events import Flag, Kind
    path = str(tmp_path / "sharded.h5")
    host = torch.randn(6, 4, generator=gen)
    x = gtmpi.signal.tensor(host, "data")
    gtmpi.trace.start(path)
    total = x.sum().numpy()  # a partial sum, summed where it lies, then read
    gtmpi.trace.stop()
    np.testing.assert_allclose(total, host.sum().numpy(), rtol=1e-5)
    trace = fileformat.read(path)
    for rank in WORKERS[:2]:
        (e,) = analysis.select(trace.events[rank], (Kind.COLLECTIVE,))
        assert trace.name(int(e["name"])) == "all_reduce_" and e["bytes"] == 4
        assert trace.name(int(e["detail"])).startswith("group ")
    inserted = analysis.select(trace.events[0], (Kind.DISPATCH,))
    inserted = inserted[(inserted["flags"] & Flag.INSERTED) != 0]
    assert sorted(int(p) for p in inserted["peer"]) == WORKERS[:2]
    assert {r["collective"] for r in analysis.collective_rows(trace)} == {"all_reduce_"}


@spread
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_over_split_rows(gen, reduction):
    logits = torch.randn(7, 5, generator=gen)
    target = torch.randint(0, 5, (7,), generator=gen)
    target[2] = -100  # ignored: the mean divides by the 6 rows that count
    x = gtmpi.signal.tensor(logits, "data").requires_grad_()
    t = gtmpi.signal.tensor(target, "data")
    before = collectives()
    loss = F.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1)
    assert where(loss) == {"mean": f"R@{WORKERS[:2]}", "sum": f"P@{WORKERS[:2]}",
                           "none": f"S(0)@{WORKERS[:2]}"}[reduction]
    assert "all_gather" not in ran_since(before)  # the logits never travel
    ref = logits.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(ref, target, reduction=reduction, label_smoothing=0.1)
    assert_same(loss, want.detach(), rtol=1e-5, atol=1e-6)
    weights = torch.randn(want.shape, generator=gen)
    (loss * gtmpi.tensor(weights)).sum().backward()
    (want * weights).sum().backward()
    assert where(x.grad) == f"S(0)@{WORKERS[:2]}"
    assert_same(x.grad, ref.grad, rtol=1e-5, atol=1e-6)


@spread
def test_placed_uploads_go_piece_by_piece_from_the_host(gen, tmp_path):
    """Each member gets its own piece straight from rank 0: no worker forwards bytes."""
    from gtmpi.recording import fileformat
    from gtmpi.trace import analysis
    from gtmpi.recording.events import Kind
    gtmpi.load_config({"part": {"mesh": {"dp": 2}, "placement": {"dp": "P"}}})
    host = torch.randn(7, 4, generator=gen)
    path = str(tmp_path / "upload.h5")
    before = collectives()
    gtmpi.trace.start(path)
    with gtmpi.signal.context("stage1"):
        one = gtmpi.tensor(torch.ones(3))
    with gtmpi.signal.context("data"):
        rows = gtmpi.tensor(host)
    with gtmpi.signal.context("weights"):
        both = gtmpi.tensor(host)
    with gtmpi.signal.context("part"):
        part = gtmpi.tensor(host)
    gtmpi.trace.stop()
    assert ran_since(before) == {}
    trace = fileformat.read(path)
    sent = [(int(e["id"]), int(e["peer"]), int(e["bytes"]))
            for e in analysis.select(trace.events[0], (Kind.TRANSFER,))]
    w0, w1 = WORKERS[:2]
    assert sent == [(one.id, w1, 12), (rows.id, w0, 64), (rows.id, w1, 48),
                    (both.id, w0, 112), (both.id, w1, 112), (part.id, w0, 112)]
    placed = sorted((trace.name(int(e["name"])), int(e["id"]), int(e["peer"]))
                    for e in analysis.select(trace.events[0], (Kind.DISPATCH,)))
    # one event per instruction the program wrote, at its first member; the zeros inserted
    assert placed == sorted([("upload", one.id, w1), ("upload", rows.id, w0),
                             ("upload", both.id, w0), ("upload", part.id, w0),
                             ("zeros", part.id, w1)])
    assert [where(t) for t in (one, rows, both, part)] == [
        f"R@{[w1]}", f"S(0)@{[w0, w1]}", f"R@{[w0, w1]}", f"P@{[w0, w1]}"]
    for t in (rows, both, part):
        assert_same(t, host)
    assert gtmpi.debug.placement(rows)["shards"] == {w0: (4, 4), w1: (3, 4)}


@spread
@pytest.mark.parametrize("make_view, placed", [
    (lambda x: x.view(8 * 6, 10), "S(0)"),                 # a split batch merged with time
    (lambda x: x.reshape(-1, 10), "S(0)"),
    (lambda x: x.view(8, 6, 2, 5), "S(0)"),                # features split into heads
    (lambda x: x.view(8, 6, 2, 5).transpose(1, 2), "S(0)"),
    (lambda x: x.flatten(0, 1), "S(0)"),
    (lambda x: x.view(4, 2, 6, 10), "S(0)"),               # the batch itself split: 4 rows/2
    (lambda x: x.unsqueeze(0).expand(3, 8, 6, 10), "S(1)"),
    (lambda x: x.view(8 * 6 * 10), "S(0)"),
    (lambda x: x.view(2, 4 * 6, 10), "S(0)"),              # each worker's 4 rows: 1 row here
    (lambda x: x.transpose(0, 1).reshape(6, 80), "S(1)"),  # each worker's 40 columns
    (lambda x: x.view(3, 16, 10), "R"),                    # 4 rows of 6 are 1.5 rows of 16
    (lambda x: x.transpose(0, 1).reshape(48, 10), "R"),    # the split dim no longer leads
])
def test_views_of_a_split_batch_keep_their_pieces(make_view, placed):
    """Reshapes that keep each worker's rows its own move no data; only one that truly mixes
    the pieces gathers (torch/distributed/tensor/_ops/_view_ops.py reasons alike)."""
    host = torch.randn(8, 6, 10)
    before = collectives()
    y = make_view(gtmpi.signal.tensor(host, "data"))
    assert where(y) == f"{placed}@{WORKERS[:2]}"
    ran = ran_since(before)
    assert ("all_gather" in ran) == (placed == "R"), ran
    assert_same(y, make_view(host))


@spread
def test_a_split_gpt_block_never_gathers_its_batch():
    """Attention written as real model code (views into heads, transposes, the fused kernel,
    a view back) keeps the batch split: no gather, the same numbers as one worker."""
    B, T, C, H = 4, 8, 16, 4
    gen = torch.Generator().manual_seed(0)
    host = torch.randn(B, T, C, generator=gen)
    w = torch.randn(3 * C, C, generator=gen) / C ** 0.5

    def block(x, w, fn=F):
        q, k, v = fn.linear(x, w).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = fn.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).contiguous().view(B, T, C)

    with gtmpi.signal.context("weights"):
        wg = gtmpi.tensor(w)
    before = collectives()
    y = block(gtmpi.signal.tensor(host, "data"), wg)
    assert where(y) == f"S(0)@{WORKERS[:2]}"
    assert "all_gather" not in ran_since(before)
    assert_same(y, block(host, w, torch.nn.functional), rtol=1e-5, atol=1e-6)


@spread
def test_strict_placement_raises_where_pieces_would_be_gathered_and_explain_lists_it():
    host = torch.randn(8, 6, 10)
    x = gtmpi.signal.tensor(host, "data")
    z = x.view(3, 16, 10)  # mixes the pieces: gathered
    line = line_of(__file__, "z = x.view(3, 16, 10)  # mixes")
    import io
    listed = gtmpi.debug.explain(io.StringIO())
    gathers = {k: v for k, v in listed.items() if k[1] == "all_gather" and not k[2]}
    assert any(site.endswith(f"test_placement.py:{line}") for site, _, _ in gathers), listed
    gtmpi.debug.strict_placement()
    try:
        with pytest.raises(PlacementError, match=r"would gather a tensor of shape \[8, 6, 10\]"):
            x.view(3, 16, 10)
        y = x.view(48, 10) * 2  # keeps the pieces: allowed
        assert_same(y, host.view(48, 10) * 2)
        assert_same(z, host.view(3, 16, 10))
    finally:
        gtmpi.debug.strict_placement(False)



@spread
def test_strict_placement_lets_a_constant_be_made_again_where_it_is_used():
    """nanoGPT's positions (arange on no device, outside any signal) meet a split batch: each
    worker makes its own copy from the constant's recipe, moving nothing, which strict placement
    let pass no more than a real move."""
    table = torch.randn(4, 3)
    w = gtmpi.signal.tensor(table, "weights")
    pos = gtmpi.arange(4, device="cuda")  # made on a worker, as nanoGPT makes it
    gtmpi.debug.strict_placement()
    try:
        before = collectives()
        y = F.embedding(pos, w)
        assert not {"send", "recv", "all_gather"} & set(ran_since(before))
    finally:
        gtmpi.debug.strict_placement(False)
    assert_same(y, table)


@spread
def test_a_mask_made_in_forward_from_constants_is_made_where_used():
    """Under a config that splits the program's uploads (configs/ddp.yaml), a causal mask made
    in forward (tril of ones, compared) and positions from arange: computed by the client from
    constants alone, they were placed as uploads, split along their first dim, and the batch's
    attention scores were gathered to meet them (strict placement refused it). Now they are
    constants, made again where they are used; torch's loss and gradients."""
    def forward(lib, q, x):
        T = x.shape[1]
        att = q(x) @ x.transpose(-2, -1)
        mask = lib.tril(lib.ones(T, T))
        att = att.masked_fill(mask == 0, float("-inf")).softmax(-1)
        return (att @ x).sum() + lib.arange(T).float().sum()

    host = torch.randn(4, 6, 8)
    ref = torch.nn.Linear(8, 8)
    gtmpi.load_config({"parameters": {"shard": {"workers": [0, 1], "replicated": True}},
                       "uploads": {"shard": {"axis": 0, "workers": [0, 1]}}})
    try:
        q = nn.Linear(8, 8)
        q.load_state_dict(ref.state_dict())
        gtmpi.debug.strict_placement()
        try:
            loss = forward(gtmpi, q, gtmpi.tensor(host))
            loss.backward()
        finally:
            gtmpi.debug.strict_placement(False)
        want = forward(torch, ref, host)
        want.backward()
        assert abs(loss.item() - want.item()) < 1e-3
        assert_same(q.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)
    finally:  # the implicit signals go again: the other tests' uploads stay whole
        from gtmpi.client.runtime import runtime
        for name in ("parameters", "uploads"):
            runtime().signals.signals.pop(name)


@spread
def test_a_scalar_the_program_uploads_goes_whole_where_it_is_used():
    """Under a config that splits the program's uploads along dim 0 (configs/ddp.yaml), a
    number it uploads beside a batch (a mean's count, made on the client from host-held
    targets) has no dim 0 to split: it goes whole to the workers of the op that reads it,
    where it once stopped the program with a config error."""
    gtmpi.load_config({"uploads": {"shard": {"axis": 0, "workers": [0, 1]}}})
    try:
        gtmpi.debug.strict_placement()
        try:
            x = gtmpi.tensor(torch.arange(8.0).reshape(4, 2))
            assert gtmpi.debug.placement(x)["type"] == "S(0)"  # on the workers, split
            count = gtmpi.tensor(torch.tensor([1, 0, 1, 1])).sum().to(gtmpi.float32)
            got = (x * 2).sum() / count  # the count: made on the client, a 0-d upload
            assert got.item() == pytest.approx(56.0 / 3)
        finally:
            gtmpi.debug.strict_placement(False)
    finally:
        from gtmpi.client.runtime import runtime
        runtime().signals.signals.pop("uploads")


@spread
def test_masked_fill_gradient_keeps_a_split_batch_split():
    """A causal mask's masked_fill: its gradient was torch's vjp on whole tensors (an all-gather
    of the scores per layer and step under data parallelism); now a where of the pieces."""
    host = torch.randn(8, 2, 4, 4)
    mask = torch.ones(4, 4).tril() == 0
    x = gtmpi.signal.tensor(host, "data").requires_grad_()
    gtmpi.debug.strict_placement()
    try:
        before = collectives()
        y = x.masked_fill(gtmpi.tensor(mask), float("-inf")).softmax(-1)
        (y * y).sum().backward()
        assert "all_gather" not in ran_since(before)
        assert where(x.grad) == f"S(0)@{WORKERS[:2]}"
    finally:
        gtmpi.debug.strict_placement(False)
    t = host.clone().requires_grad_()
    ty = t.masked_fill(mask, float("-inf")).softmax(-1)
    (ty * ty).sum().backward()
    assert_same(x.grad, t.grad, rtol=1e-5, atol=1e-6)


@spread
def test_data_parallel_gpt_in_strict_mode_reduces_gradients_and_gathers_nothing():
    """The GPT of examples/gpt (real model code: views into heads, transposes, fused ops) under
    the data-parallel config trains like torch with nothing gathered, in strict mode: per step
    only the gradients' all-reduces, the loss's, the batch's upload and the replicas' checks."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    from examples.gpt.model import SIZES, build
    c = SIZES["tiny"]
    torch.manual_seed(0)
    ref = build(torch)(c)
    with gtmpi.signal.context("weights"):
        model = build(gtmpi)(c)
    gtmpi.debug.strict_placement()
    try:
        model.load_state_dict(ref.state_dict())
        opt, topt = gtmpi.optim.AdamW(model.parameters()), torch.optim.AdamW(ref.parameters())
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            data = torch.randint(0, c.vocab, (8, c.seq + 1), generator=gen)
            x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
            before, before_bytes = collectives(), collectives(1)
            opt.zero_grad()
            loss = model(gtmpi.signal.tensor(x, "data"), gtmpi.signal.tensor(y, "data"))
            loss.backward()
            opt.step()
            got = loss.item()
            ran, moved = ran_since(before), ran_since(before_bytes, 1)
            topt.zero_grad()
            want = ref(x, y)
            want.backward()
            topt.step()
            assert abs(got - want.item()) < 1e-4
            # on each worker: the gradients as one bucket (the model is small), the loss's two
            # sums, and the gradient flowing into the position table (its rows are looked up by
            # replicated indices, so that embedding runs whole: the (T, dim) gradient reaching
            # it is summed rather than the table's gradient, the same bytes here as T = seq)
            weights = sum(p.numel() for p in model.parameters()) * 4
            assert ran["all_reduce"] == 2 * (1 + 2 + 1) and "all_gather" not in ran, ran
            assert moved["all_reduce"] == 2 * (weights + 2 * 4), moved
    finally:
        gtmpi.debug.strict_placement(False)


@spread
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocabulary_parallel_embedding_and_cross_entropy_match_torch(gen, reduction):
    """A table split along its rows looked up by whole indices gives partial sums (each member
    its rows, zeros elsewhere); logits split along the classes give torch's cross-entropy
    (ignored targets and uneven pieces included) and its gradient, with no gather."""
    table = torch.randn(11, 6, generator=gen)  # 11 rows: pieces of 6 and 5
    idx = torch.randint(0, 11, (3, 4), generator=gen)
    logits = torch.randn(7, 11, generator=gen)
    target = torch.randint(0, 11, (7,), generator=gen)
    target[2] = -100
    with gtmpi.signal.context("col"):
        g_table = gtmpi.tensor(table, requires_grad=True)
    with gtmpi.signal.context("row"):
        g_logits = gtmpi.tensor(logits, requires_grad=True)
    with gtmpi.signal.context("weights"):
        g_idx, g_target = gtmpi.tensor(idx), gtmpi.tensor(target)
    t_table, t_logits = table.clone().requires_grad_(), logits.clone().requires_grad_()
    before = collectives()
    looked = F.embedding(g_idx, g_table)
    loss = F.cross_entropy(g_logits, g_target, reduction=reduction)
    assert where(looked) == f"P@{WORKERS[:2]}" and where(loss) == f"R@{WORKERS[:2]}"
    weights = torch.randn(looked.shape, generator=gen)
    upstream = torch.randn(loss.shape, generator=gen)
    ((looked * gtmpi.signal.tensor(weights, "weights")).sum() +
     (loss * gtmpi.signal.tensor(upstream, "weights")).sum()).backward()
    ran = ran_since(before)  # before the reads below, which gather and sum what they read
    assert "all_gather" not in ran and "send" not in ran, ran
    ((torch.nn.functional.embedding(idx, t_table) * weights).sum() +
     (torch.nn.functional.cross_entropy(t_logits, target, reduction=reduction) * upstream).sum()
     ).backward()
    assert_same(looked, torch.nn.functional.embedding(idx, table), rtol=1e-5, atol=1e-6)
    assert_same(loss, torch.nn.functional.cross_entropy(logits, target, reduction=reduction),
                rtol=1e-5, atol=1e-6)
    assert where(g_table.grad) == f"S(0)@{WORKERS[:2]}"
    assert where(g_logits.grad) == f"S(1)@{WORKERS[:2]}"
    assert_same(g_table.grad, t_table.grad, rtol=1e-5, atol=1e-6)
    assert_same(g_logits.grad, t_logits.grad, rtol=1e-5, atol=1e-6)


def megatron_gpt(config: str, vocab: int | None = None) -> tuple:
    """The tiny GPT (of ``vocab`` tokens if given) on torch and on gtmpi with the same weights,
    the latter's placed by Megatron's layout under configs/``config``; and a batch (inputs,
    targets)."""
    import dataclasses
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from examples.gpt.model import SIZES, build, tensor_parallel
    c = SIZES["tiny"] if vocab is None else dataclasses.replace(SIZES["tiny"], vocab=vocab)
    gtmpi.load_config(str(root / "configs" / config))
    torch.manual_seed(0)
    ref = build(torch)(c)
    model = build(gtmpi)(c)
    model.load_state_dict(ref.state_dict())
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, signal in tensor_parallel(model).items():
        gtmpi.signal.place(tensors[name], signal)
    data = torch.randint(0, c.vocab, (4, c.seq + 1), generator=torch.Generator().manual_seed(1))
    return c, ref, model, (data[:, :-1].contiguous(), data[:, 1:].contiguous())


@spread
@pytest.mark.parametrize("vocab", [None, 257])
def test_megatron_tensor_parallel_gpt_runs_megatrons_all_reduces_only(vocab):
    """The GPT with Megatron's layout (configs/gpt_tp2.yaml: QKV and the MLP's first layer
    column-parallel, heads split with them; the output projections row-parallel; the token
    embedding and the head split along the vocabulary, the loss the parallel cross-entropy)
    gives torch's loss and gradients in strict mode, with per block one all-reduce after each
    row-parallel layer in forward and one at each column-parallel layer's input in backward,
    one after the embedding and one at the head's input in backward: nothing else moves
    (the cross-entropy's own three sums per row run inside its kernel), and the weights stay
    in halves. A vocabulary of 257 (the seed's Mini-GPT has 50257) splits unevenly: the
    logits stay in their uneven pieces through the loss, nothing gathered."""
    c, ref, model, (x, y) = megatron_gpt("gpt_tp2.yaml", vocab)
    from examples.gpt.model import tensor_parallel
    gtmpi.debug.strict_placement()
    try:
        before, before_bytes = collectives(), collectives(1)
        loss = model(gtmpi.signal.tensor(x, "act"), gtmpi.signal.tensor(y, "act"))
        loss.backward()
        got = loss.item()
        ran, moved = ran_since(before), ran_since(before_bytes, 1)
    finally:
        gtmpi.debug.strict_placement(False)
    want = ref(x, y)
    want.backward()
    assert abs(got - want.item()) < 1e-5
    # 2 workers × (layers × (2 in forward + 2 in backward) + 2), each of a (B, T, dim)
    # activation; the read of the loss: an agreement (and nothing gathered)
    reduces = 2 * (c.layers * 4 + 2)
    assert ran == {"all_reduce": reduces, "agree": 2}, ran
    assert moved["all_reduce"] == reduces * 4 * c.seq * c.dim * 4
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        kind = {"col": "S(0)", "vocab": "S(0)", "row": "S(1)",
                "rep": "R"}[tensor_parallel(model)[name]]
        assert where(p) == f"{kind}@{WORKERS[:2]}", name


def test_sequence_parallel_rules():
    """Megatron-SP as placement rules: a column-parallel linear of an input split along the
    sequence gathers it (the weight keeps its split), a partial sum beside a split operand is
    reduce-scattered into lined-up pieces, and a whole operand added to a partial sum is taken
    as one (the row-parallel bias)."""
    from gtmpi.placement.rules import plan
    from gtmpi.placement.types import Placement
    mesh = (1, 2)
    R, P = Placement(mesh, "R"), Placement(mesh, "P")
    S = [Placement(mesh, "S", d) for d in range(3)]
    act, weight, bias = ((4, 8, 6), torch.float32), ((10, 6), torch.float32), ((10,), torch.float32)
    col = plan("linear", mesh, (), (1, 2, 3), 7, None, [S[1], S[0], S[0]], [act, weight, bias])
    assert col.wants == (R, S[0], S[0]) and col.out == S[2] and col.intended
    add = plan("add", mesh, (), (1, 2), 3, None, [S[1], P], [act, act])
    assert add.wants == (S[1], S[1]) and add.out == S[1]
    biased = plan("add", mesh, (), (1, 2), 3, None, [P, R], [act, ((6,), torch.float32)])
    assert biased.wants == (P, P) and biased.out == P


@spread
def test_sequence_parallel_gpt_gives_tensor_parallels_numbers():
    """The GPT with configs/gpt_tp2_sp.yaml's 'seq' signal cutting each block's input along the
    sequence (what examples/gpt/train.py does): torch's loss and gradients, and in forward each
    block's all-reduces become an all-gather before each column-parallel layer and a
    reduce-scatter after each row-parallel one."""
    c, ref, model, (x, y) = megatron_gpt("gpt_tp2_sp.yaml")
    for m in [*model.blocks, model.ln]:
        m.register_forward_pre_hook(lambda m, args: (gtmpi.signal.tensor(args[0], "seq"),))
    xs, ys = gtmpi.signal.tensor(x, "act"), gtmpi.signal.tensor(y, "act")
    def inserted() -> dict[str, int]:  # by kind, as the dispatcher inserted them (gloo runs a
        counts: dict[str, int] = {}     # reduce-scatter as an all-reduce and a cut)
        for (_, kind, _), (n, _) in gtmpi.debug.explain(io.StringIO()).items():
            counts[kind] = counts.get(kind, 0) + n
        return counts

    gtmpi.debug.strict_placement()  # every collective is the layout's own
    try:
        before = inserted()
        loss = model(xs, ys)
        forward = {k: n - before.get(k, 0) for k, n in inserted().items() if n - before.get(k, 0)}
        loss.backward()
        got = loss.item()
    finally:
        gtmpi.debug.strict_placement(False)
    want = ref(x, y)
    want.backward()
    assert abs(got - want.item()) < 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    # per worker: the embedding's sum cut into pieces, then per block 2 gathers and 2
    # reduce-scatters, and the head's input gathered; no all-reduce of an activation
    workers = 2
    assert forward.get("reduce_scatter") == workers * (1 + 2 * c.layers), forward
    assert forward.get("all_gather") == workers * (2 * c.layers + 1), forward
    assert not any(k.startswith("all_reduce") for k in forward), forward


@spread
def test_constants_made_outside_signals_are_made_where_they_are_used():
    """A causal mask built from arange in the forward pass, outside any signal, is made again
    on the workers of the split batch (from how it was made), never sent; a tensor changed in
    place since is sent as before."""
    host = torch.randn(8, 5, 5)
    x = gtmpi.signal.tensor(host, "data")
    before = collectives()
    mask = gtmpi.arange(5)[:, None] >= gtmpi.arange(5)[None, :]
    y = x * mask
    assert where(y) == f"S(0)@{WORKERS[:2]}"
    assert not ran_since(before), ran_since(before)
    want_mask = torch.arange(5)[:, None] >= torch.arange(5)[None, :]
    assert_same(y, host * want_mask)
    ones = gtmpi.ones(5, 5, device="cuda")  # made by the first worker
    ones += 1  # no longer what its recipe makes
    before = collectives()
    assert_same(x * ones, host * 2)
    assert ran_since(before).get("send") == 1
    held = gtmpi.ones(5, 5)
    held += 1
    before = collectives()
    assert_same(x * held, host * 2)
    if os.environ.get("GTMPI_HOST_TENSORS") != "0":
        # the client's value went to each member where it was used: nothing between workers
        assert "send" not in ran_since(before)


@spread
def test_gtmpi_trace_comms_lists_what_was_inserted_by_line(tmp_path, capsys):
    from gtmpi.cli import trace_main
    from gtmpi.recording import fileformat
    from gtmpi.trace import analysis
    path = str(tmp_path / "comms.h5")
    x = gtmpi.signal.tensor(torch.randn(8, 6, 10), "data")
    gtmpi.trace.start(path)
    z = x.view(3, 16, 10)  # traced: mixes the pieces
    line = line_of(__file__, "z = x.view(3, 16, 10)  # traced")
    z.sum().item()
    gtmpi.trace.stop()
    rows = analysis.comm_rows(fileformat.read(path))
    gathers = [r for r in rows if r["kind"] == "all_gather"]
    assert len(gathers) == 1 and gathers[0]["where"].endswith(f"test_placement.py:{line}")
    assert gathers[0]["why"] == "inserted" and gathers[0]["count"] == 2
    assert gathers[0]["bytes"] == 8 * 6 * 10 * 4  # the two pieces
    assert trace_main(["comms", path]) == 0
    assert f"test_placement.py:{line}" in capsys.readouterr().out


@spread
@pytest.mark.parametrize("form", ["matmul", "bmm", "einsum"])
def test_batched_products_of_a_split_batch_stay_split(form):
    """Data parallel attention written by hand (q @ kᵀ, att @ v, bmm, einsum): the batch stays
    split through the products and their gradients; nothing is gathered (strict placement),
    only the weight's gradient is summed; numbers as torch's."""
    everyone = list(range(len(WORKERS)))
    gtmpi.load_config({"bp_data": {"shard": {"axis": 0, "workers": everyone}},
                       "bp_weights": {"shard": {"workers": everyone, "replicated": True}}})
    torch.manual_seed(0)
    xt, wt = torch.randn(4, 5, 8), torch.randn(8, 8)
    with gtmpi.signal.context("bp_weights"):
        w = gtmpi.tensor(wt, requires_grad=True)
    x = gtmpi.signal.tensor(xt, "bp_data")
    before = {r: dict(s["collectives"]) for r, s in gtmpi.debug.worker_stats().items()}
    gtmpi.debug.strict_placement()
    try:
        q = x @ w
        if form == "matmul":
            y = (q @ q.transpose(-2, -1)).softmax(-1) @ q
        elif form == "bmm":
            y = gtmpi.bmm(gtmpi.bmm(q, q.transpose(1, 2)).softmax(-1), q)
        else:
            y = gtmpi.einsum("bts,bsc->btc", gtmpi.einsum("btc,bsc->bts", q, q).softmax(-1), q)
        assert gtmpi.debug.placement(y)["type"] == "S(0)"
        loss = y.square().sum()
        loss.backward()
    finally:
        gtmpi.debug.strict_placement(False)
    ref = wt.clone().requires_grad_()
    qt = xt @ ref
    ((qt @ qt.transpose(-2, -1)).softmax(-1) @ qt).square().sum().backward()
    torch.testing.assert_close(w.grad.cpu_torch(), ref.grad, rtol=1e-4, atol=1e-4)
    after = gtmpi.debug.worker_stats()[WORKERS[0]]["collectives"]
    assert "all_gather" not in after or after["all_gather"] == before[WORKERS[0]].get("all_gather")


@pytest.mark.parametrize("equation, shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]), ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij->i", [(3, 4)]), ("i,j->ij", [(3,), (4,)]), ("bhqd,bhkd->bhqk", [(2, 2, 3, 4)] * 2)])
def test_einsum_gradients_match_torch(equation, shapes):
    torch.manual_seed(1)
    ts = [torch.randn(s, requires_grad=True) for s in shapes]
    gs = [gtmpi.tensor(t.detach(), requires_grad=True) for t in ts]
    torch.einsum(equation, *ts).square().sum().backward()
    gtmpi.einsum(equation, *gs).square().sum().backward()
    for t, g in zip(ts, gs):
        torch.testing.assert_close(g.grad.cpu_torch(), t.grad, rtol=1e-5, atol=1e-5)


BATCH_KINDS = """
    import json, os, sys
    import numpy as np
    import torch
    import gtmpi
    import gtmpi.nn as nn
    import gtmpi.nn.functional as F
    from gtmpi.client.runtime import runtime
    from gtmpi.utils.data import DataLoader, TensorDataset

    gtmpi.manual_seed(0)
    torch.manual_seed(0)
    N = 2048  # a dataset larger than the client computes on by itself (host.HOST_NUMEL)
    X, Y = torch.randn(N, 1, 8, 8), torch.randint(0, 4, (N,))
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(4 * 16, 4))
    ref = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 16, 4))
    ref.load_state_dict({k: v.cpu_torch() for k, v in model.state_dict().items()})
    opt = gtmpi.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    Xg, Yg = gtmpi.tensor(X), gtmpi.tensor(Y)
    loader = iter(DataLoader(TensorDataset(X, Y), batch_size=32, shuffle=True, generator=gen))
    loader_g = iter(DataLoader(TensorDataset(Xg, Yg), batch_size=32, shuffle=True,
                               generator=gen))

    def rows(i):
        return X[i * 32:(i + 1) * 32], Y[i * 32:(i + 1) * 32]

    KINDS = {
        "loader": lambda i: next(loader),
        "loader over gtmpi tensors": lambda i: next(loader_g),
        "indices": lambda i: (lambda idx: (Xg[idx], Yg[idx]))(torch.randint(0, N, (32,),
                                                                             generator=gen)),
        "device=": lambda i: tuple(gtmpi.tensor(t, device="cuda") for t in rows(i)),
        "from_numpy .to": lambda i: tuple(gtmpi.from_numpy(t.numpy()).to("cuda")
                                          for t in rows(i)),
        "pinned": lambda i: tuple(gtmpi.tensor(t).pin_memory().to("cuda", non_blocking=True)
                                  for t in rows(i)),
        ".cuda()": lambda i: tuple(gtmpi.tensor(t).cuda() for t in rows(i)),
    }
    if os.environ["GTMPI_HOST_TENSORS"] == "0":
        # the dataset went to the workers at once, split as an upload: rows picked from it
        # by the program's own indices gather it (a TensorDataset's are kept whole instead)
        del KINDS["indices"]
    placer = runtime().dispatcher.placer
    report = {}
    def counts():
        found = {}
        for (_, what, _), (n, _) in placer.inserted.items():
            found[what] = found.get(what, 0) + n
        return found

    for kind, make in KINDS.items():
        losses, want, ran = [], [], {}
        for i in range(3):
            before = counts()
            x, y = make(i)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            for what, n in counts().items():  # the step's own, not the reads below
                if n - before.get(what, 0):
                    ran[what] = ran.get(what, 0) + n - before.get(what, 0)
            tl = torch.nn.functional.cross_entropy(ref(x.cpu_torch()), y.cpu_torch())
            tl.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            want.append(tl.item())
        report[kind] = {"losses": losses, "torch": want, "collectives": ran}
    print("REPORT " + json.dumps(report))
"""


@pytest.mark.skipif(len(WORKERS) > 1, reason="starts its own job (the serial suite)")
@pytest.mark.timeout(200)
@pytest.mark.parametrize("held", ["1", "0"])
def test_every_kind_of_batch_is_split_by_a_data_parallel_config(tmp_path, held):
    """A CNN under configs/ddp.yaml on 2 workers, its batches made every common way (a
    DataLoader over a TensorDataset of host or gtmpi tensors, shuffled; rows picked by random
    indices; tensor(device=); from_numpy().to(); pin_memory().to(non_blocking=True);
    .cuda()), with host tensors held or not: the loop gathers nothing, sums the gradients,
    and its losses are torch's on one device."""
    proc, _ = run_job(tmp_path, BATCH_KINDS, 180, n=3,
                      env={"GTMPI_CONFIG": str(ROOT / "configs" / "ddp.yaml"),
                           "GTMPI_HOST_TENSORS": held})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("REPORT "))
    for kind, got in json.loads(line[len("REPORT "):]).items():
        assert got["losses"] == pytest.approx(got["torch"], rel=1e-5, abs=1e-6), kind
        assert "all_gather" not in got["collectives"], (kind, got["collectives"])
        assert got["collectives"].get("all_reduce_bucket", 0) >= 3, (kind, got["collectives"])
    assert "placed nothing" not in proc.stderr and "never used" not in proc.stderr


CONSTANTS = """
    import json, sys
    import torch
    import gtmpi
    import gtmpi.nn as nn
    from gtmpi.client.runtime import runtime

    torch.manual_seed(0)
    B, T, C = 8, 4, 6
    model = nn.Linear(C, C)
    ref = torch.nn.Linear(C, C)
    ref.load_state_dict({k: v.cpu_torch() for k, v in model.state_dict().items()})
    values = {"scale": torch.randn(C), "bias": torch.randn(T, C), "idx": torch.tensor([0, 2, 5])}
    CASES = {
        "a per-channel scale": lambda h, c: h * c["scale"],
        "a (T, C) bias": lambda h, c: h + c["bias"],
        "index_select by an index list": lambda h, c: h.index_select(2, c["idx"]),
        "x[:, :, idx]": lambda h, c: h[:, :, c["idx"]],
        "x[::2]": lambda h, c: h[::2],  # each member's rows of it are its pieces
        "x[1::2]": lambda h, c: h[1::2],
    }
    placer = runtime().dispatcher.placer
    report = {}
    for name, f in CASES.items():
        xt = torch.randn(B, T, C)
        before = dict(placer.inserted)
        device = sys.argv[1] if len(sys.argv) > 1 else None  # "cuda": made on the workers
        out = f(model(gtmpi.tensor(xt, device=device)),
                {k: gtmpi.tensor(v, device=device) for k, v in values.items()})
        split = gtmpi.debug.placement(out)["type"]
        loss = out.pow(2).mean()
        loss.backward()
        ran = {}
        for key, (n, _) in placer.inserted.items():
            if n - before.get(key, (0, 0))[0]:
                ran[key[1]] = ran.get(key[1], 0) + n - before.get(key, (0, 0))[0]
        want = f(ref(xt), values).pow(2).mean()
        want.backward()
        report[name] = {"loss": loss.item(), "torch": want.item(), "split": split,
                        "grad": (model.weight.grad.cpu_torch() - ref.weight.grad).abs().max().item(),
                        "collectives": ran}
        model.zero_grad()
        ref.zero_grad()
    print("REPORT " + json.dumps(report))
"""


@pytest.mark.skipif(len(WORKERS) > 1, reason="starts its own job (the serial suite)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("host_tensors, device", [("1", None), ("0", None), ("1", "cuda")])
def test_constants_beside_a_split_batch_stay_whole_and_gather_nothing(tmp_path, host_tensors,
                                                                      device):
    """Under configs/ddp.yaml on 2 workers, constants the program makes from host values (a
    per-channel scale, a (T, C) bias, an index list for index_select or x[:, :, idx]) are used
    whole where the batch is split, and a strided slice of the batch (x[::2]) is cut by each
    member from its own rows: the batch stays split, nothing is gathered, and the numbers are
    torch's. The same whether the client holds them first or not (host tensors off, or made
    with device="cuda"): each waits for its first use, which tells a constant from a batch."""
    proc, _ = run_job(tmp_path, CONSTANTS, 100, n=3, args=[device] if device else [],
                      env={"GTMPI_CONFIG": str(ROOT / "configs" / "ddp.yaml"),
                           "GTMPI_HOST_TENSORS": host_tensors})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("REPORT "))
    for name, got in json.loads(line[len("REPORT "):]).items():
        assert got["loss"] == pytest.approx(got["torch"], rel=1e-5), name
        assert got["grad"] < 1e-5, name
        assert got["split"] == "S(0)", (name, got["split"])
        assert "all_gather" not in got["collectives"], (name, got["collectives"])


def test_a_config_that_placed_nothing_says_so_at_the_first_backward():
    from gtmpi.client.signalbook import SignalBook
    placer = types.SimpleNamespace(zero={})  # the book's own, not the session's placer
    book = SignalBook(placer, [1, 2])
    book.register(parse({"paramters": {"shard": {"workers": "all", "replicated": True}}},
                        "ddp.yaml"))
    with pytest.warns(UserWarning, match="paramters placed nothing before the first backward"):
        book.check_used()
    book.used.add("paramters")  # its report at exit has nothing to say
    used = SignalBook(placer, [1, 2])
    used.register(parse({"uploads": {"shard": {"axis": 0, "workers": "all"}}}, "ddp.yaml"))
    used.used.add("uploads")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        used.check_used()


def test_a_stage_that_holds_none_of_a_layers_kind_leaves_its_part_unused_without_a_word():
    """The seed's Mini-GPT on TP=2 x PP=4: a middle stage has no vocabulary, the last no
    blocks; their parts of the config (stage1.vocab, stage3.col) are no misspelling."""
    from gtmpi.client.signalbook import SignalBook
    book = SignalBook(types.SimpleNamespace(zero={}), [1, 2])
    body = {"shard": {"workers": [0, 1], "replicated": True}}
    book.register(parse({name: body for name in ("stage1", "stage1.vocab", "stage2",
                                                 "stage2.col", "other")}, "pp.yaml"))
    book.used.update({"stage1"})
    assert book.unused() == ["other", "stage2", "stage2.col"]
    book.used.update(book.signals)  # its report at exit has nothing to say
