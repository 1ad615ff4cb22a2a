"""Compiled replay (GTMPI_COMPILE, worker/compiled.py): a captured program traced whole into aten
ops and compiled, then captured as a CUDA graph (on CPU workers the stand-in backend). Traced and
run as it is (GTMPI_COMPILE=fx) it must give eager replay's numbers bit for bit, for every op a
program calls and for a whole training step; what it cannot take runs as today, with the reason
in explain(); Inductor's numbers (GTMPI_COMPILE=1) agree within rounding."""
from __future__ import annotations

import io
import os
import shutil

import pytest
import torch

import gtmpi
from conftest import HOME_DEVICE, run_job
from gtmpi.client.runtime import runtime
from test_capture import SIZES, _decoder_as_written, _generate, _loop
from test_dp_ops import CASES, INPUTS, GRAD, _backward, _results
from test_replay import WORKERS, _train, data_parallel, spread, tensor_parallel_run

GRAPHS = "1" if HOME_DEVICE.type == "cuda" else "emulate"


@pytest.fixture(autouse=True)
def graphed(monkeypatch):
    monkeypatch.setenv("GTMPI_CUDA_GRAPHS", GRAPHS)


def _compiles() -> tuple[int, int]:
    """Programs compiled and refused so far, over the workers."""
    stats = gtmpi.debug.worker_stats().values()
    return sum(s["compiles"] for s in stats), sum(s["compile_refusals"] for s in stats)


def _explained() -> str:
    out = io.StringIO()
    gtmpi.debug.explain(file=out)
    return out.getvalue()


def _adamw(params):
    return gtmpi.optim.AdamW(params, lr=1e-2)


def test_a_compiled_training_step_gives_eager_replays_numbers_bit_for_bit(monkeypatch):
    monkeypatch.setenv("GTMPI_COMPILE", "0")
    plain_losses, plain_weights, _, _ = _loop("1", monkeypatch, _adamw, 8)
    monkeypatch.setenv("GTMPI_COMPILE", "fx")
    before = _compiles()
    losses, weights, _, _ = _loop("1", monkeypatch, _adamw, 8)
    compiled, refused = (a - b for a, b in zip(_compiles(), before))
    assert losses == plain_losses
    for key, w in plain_weights.items():
        assert torch.equal(weights[key], w), key
    # the forward and its backward (through the fused ops' Redo records); the clipping's
    # program is the first loop's, captured uncompiled
    notes = _explained()
    assert compiled >= 2 and refused == 0, notes
    assert "backward: a CUDA graph on worker(s) 1 (compiled by its traced graph" in notes, notes


def test_dropout_compiled_draws_the_same_masks_run_after_run(monkeypatch):
    """Dropout's masks in a compiled program come from a counted hash of each op's seed (not
    torch's generator): the same seeds, the same losses; kept at the rate asked."""
    monkeypatch.setenv("GTMPI_COMPILE", "fx")
    before = _compiles()
    first, _, _, _ = _loop("1", monkeypatch, _adamw, 6, dropout=0.5)
    again, _, _, _ = _loop("1", monkeypatch, _adamw, 6, dropout=0.5)
    compiled, refused = (a - b for a, b in zip(_compiles(), before))
    assert refused == 0 and compiled >= 2, _explained()
    assert first == again
    plain, _, _, _ = _loop("1", monkeypatch, _adamw, 6)
    assert first[2:] != plain[2:]  # the replayed steps dropped something
    from gtmpi.worker import compiled as compiling
    kept = compiling._COUNTED["dropout_mask"]((1000, 1000), 0.3, torch.tensor(12345), "cpu")
    assert abs(kept.float().mean().item() - 0.7) < 0.002


def test_attention_dropout_compiled_drops_the_same_probabilities_forward_and_backward(
        monkeypatch):
    """With the values the identity, attention's output is its dropped probabilities P; the
    values' gradient of sum(out * w) is P^T w only if the backward's recompute drew the
    forward's mask."""
    monkeypatch.setenv("GTMPI_COMPILE", "fx")
    gen = torch.Generator().manual_seed(5)
    T = 16
    q, k = (gtmpi.tensor(torch.randn(2, 2, T, 8, generator=gen)).requires_grad_()
            for _ in range(2))
    v = gtmpi.tensor(torch.eye(T).expand(2, 2, T, T).contiguous()).requires_grad_()
    w = gtmpi.tensor(torch.randn(2, 2, T, T, generator=gen))

    @gtmpi.replayable
    def step(q, k, v):
        out = gtmpi.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5,
                                                                is_causal=True)
        (out * w).sum().backward()
        return out.detach()

    before = _compiles()
    outs = []
    for _ in range(5):
        q.grad = k.grad = v.grad = None
        outs.append(step(q, k, v).cpu_torch())
    compiled, refused = (a - b for a, b in zip(_compiles(), before))
    assert (compiled, refused) == (1, 0), _explained()
    probs = outs[-1]
    torch.testing.assert_close(v.grad.cpu_torch(), probs.transpose(-2, -1) @ w.cpu_torch())
    below = torch.ones(T, T, dtype=torch.bool).tril()
    assert (probs[..., ~below] == 0).all()  # causal
    dropped = (probs[..., below] == 0).float().mean().item()
    assert 0.4 < dropped < 0.6, dropped
    assert not torch.equal(outs[-1], outs[-2])  # a mask of its own each call


@pytest.mark.parametrize("reduction, ignore, autocast", [
    ("mean", -100, False), ("sum", 0, False), ("none", -100, False), ("mean", -100, True)],
    ids=["mean", "sum-ignoring-0", "none", "cuda-autocast"])
def test_the_compiled_losss_gradient_is_eager_replays_bit_for_bit(reduction, ignore, autocast,
                                                                   monkeypatch):
    """The cross-entropy's compiled backward writes its one-hot as a comparison (so Inductor
    fuses it into log_softmax's backward): the gradient is eager replay's bit for bit, with
    ignored targets (ignore_index 0 too), every reduction, and CUDA autocast's form (nll_loss
    in float32 over bfloat16 log-probabilities)."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if autocast else torch.float32
    logits = gtmpi.tensor(torch.randn(12, 10, generator=gen).to(dtype)).requires_grad_()
    target = torch.randint(0, 10, (12,), generator=gen)
    target[[2, 7]] = ignore
    target = gtmpi.tensor(target)
    F = gtmpi.nn.functional

    def run(mode: str) -> list:
        monkeypatch.setenv("GTMPI_COMPILE", mode)

        @gtmpi.replayable
        def step(x):
            with gtmpi.autocast("cuda", dtype=gtmpi.bfloat16, enabled=autocast):
                loss = F.cross_entropy(x, target, ignore_index=ignore, reduction=reduction)
            (loss.sum() if reduction == "none" else loss).backward()
            return loss.detach()
        outs = []
        for _ in range(5):
            logits.grad = None
            outs.append((step(logits).cpu_torch(), logits.grad.cpu_torch()))
        return outs

    plain = run("0")
    before = _compiles()
    compiled = run("fx")
    done, refused = (a - b for a, b in zip(_compiles(), before))
    assert done == 1 and refused == 0, _explained()
    for (want_loss, want_grad), (loss, grad) in zip(plain, compiled):
        assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)
    assert compiled[-1][1].abs().sum() > 0 and (compiled[-1][1][[2, 7]] == 0).all()


def test_the_compiled_losss_backward_is_elementwise_around_its_kernels():
    """No scatter into zeros (which Inductor cannot fuse: the one-hot written whole, then read
    by log_softmax's backward) and no gather in the traced backward of the loss."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from gtmpi.ops.table import SAVED_FORMS
    backward = SAVED_FORMS["cross_entropy"][1]
    traced = make_fx(lambda g, x, t: backward(g, (x, t, -100, "mean", 0.0), (True,), (0,)))(
        torch.tensor(1.0), torch.randn(6, 5, dtype=torch.bfloat16),
        torch.tensor([0, 1, 2, 3, 4, -100]))
    ops = {str(n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert not {op for op in ops if "scatter" in op or "gather" in op}, ops
    assert "aten._log_softmax_backward_data.default" in ops, ops


def test_the_loading_call_copies_only_the_inputs_a_program_writes():
    """A compiled program's first call on a GPU (which loads its kernels) runs on the inputs
    themselves, but on copies of those it writes: directly, through a view, in a list."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from gtmpi.worker.compiled import _written

    def program(a, b, c, d, e):
        a.add_(1)
        c.view(2, 2)[0].mul_(2)
        torch._foreach_add_([d], [b])
        return (b * 2 + e,)
    assert _written(make_fx(program)(*[torch.ones(4) for _ in range(5)])) == {0, 2, 3}


def test_a_program_drawing_what_cannot_be_counted_is_replayed_uncompiled_and_says_why(
        monkeypatch):
    monkeypatch.setenv("GTMPI_COMPILE", "fx")
    x = gtmpi.tensor(torch.ones(4, 4))

    @gtmpi.replayable
    def noisy(x):
        return x + gtmpi.randn(4, 4)

    before = _compiles()
    for _ in range(4):
        noisy(x)
    compiled, refused = (a - b for a, b in zip(_compiles(), before))
    assert (compiled, refused) == (0, 1)
    assert "not compiled: RuntimeError: it draws random numbers by randn" in _explained()


@spread
@pytest.mark.parametrize("layout", [data_parallel, tensor_parallel_run],
                         ids=["data", "tensor"])
def test_parallel_programs_compile_with_their_collectives_and_give_eager_numbers(
        layout, monkeypatch):
    """A data (tensor) parallel step's programs hold the gradients' sums (Megatron's sums):
    traced as torch's functional collectives, they move what eager replay moves, and every
    loss and gradient is eager replay's bit for bit."""
    gtmpi.debug.strict_placement()
    try:
        monkeypatch.setenv("GTMPI_COMPILE", "0")
        plain = _train(True, *layout())
        monkeypatch.setenv("GTMPI_COMPILE", "fx")
        before = _compiles()
        got = _train(True, *layout())
    finally:
        gtmpi.debug.strict_placement(False)
    compiled, refused = (a - b for a, b in zip(_compiles(), before))
    assert refused == 0 and compiled >= len(WORKERS), _explained()
    assert got[0] == plain[0]
    for key, grad in plain[1].items():
        assert torch.equal(got[1][key], grad), key
    moved = got[2][WORKERS[0]]
    assert moved == plain[2][WORKERS[0]] and moved.get("all_reduce", 0) > 0, (moved, plain[2])


@spread
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_programs_compile_with_their_reduce_scatters_and_gathers(zero, monkeypatch):
    """ZeRO-2's gradients reduce-scattered in buckets, ZeRO-3's weights gathered too: traced as
    functional collectives, bit for bit eager replay's losses and weights."""
    from test_zero import _train as zero_train
    monkeypatch.setenv("GTMPI_COMPILE", "0")
    plain = zero_train(zero, "adamw", steps=5, replay=True)
    monkeypatch.setenv("GTMPI_COMPILE", "fx")
    before = _compiles()
    got = zero_train(zero, "adamw", steps=5, replay=True)
    compiled, refused = (a - b for a, b in zip(_compiles(), before))
    assert refused == 0 and compiled >= len(WORKERS), _explained()
    assert got["losses"] == plain["losses"]
    for a, b in zip(got["weights"], plain["weights"]):
        assert torch.equal(a, b)
    assert got["ran"] == plain["ran"] and got["ran"].get("reduce_scatter", 0) > 0, got["ran"]


def _case(fn, names: str, calls: int) -> tuple[list, list]:
    """An op's case as a replayable function called ``calls`` times on the same operands: the
    last call's results and the gradients accumulated into its operands."""
    operands = [gtmpi.tensor(INPUTS[n].clone()).requires_grad_(n in GRAD) for n in names.split()]

    @gtmpi.replayable
    def step(*xs):
        results = _results(fn(gtmpi, gtmpi.nn.functional, *xs))
        _backward(results, gtmpi)
        return tuple(r.detach() for r in results)

    for _ in range(calls):
        got = step(*operands)
    return ([g.cpu_torch() if isinstance(g, gtmpi.Tensor) else g for g in got],
            [None if o.grad is None else o.grad.cpu_torch() for o in operands])


# torch's eager gradient of prod picks its formula by whether an operand holds a zero, which a
# trace over fake tensors cannot see: it takes the formula right for both (equal within rounding)
ROUNDED = {"prod"}


@pytest.mark.skipif(len(gtmpi.info()["workers"]) > 1,
                    reason="a translation per worker: the one-worker suite checks it")
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_op_compiled_gives_eager_replays_numbers_bit_for_bit(name, monkeypatch):
    fn, names = CASES[name]
    monkeypatch.setenv("GTMPI_COMPILE", "0")
    want = _case(fn, names, 4)
    monkeypatch.setenv("GTMPI_COMPILE", "fx")
    before = _compiles()
    got = _case(fn, names, 4)
    compiled, refused = (a - b for a, b in zip(_compiles(), before))
    assert (compiled, refused) == (1, 0), _explained()
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        if isinstance(w, torch.Tensor) and name in ROUNDED:
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (g, w)
        elif isinstance(w, torch.Tensor):
            assert torch.equal(g, w), (g, w)
        else:
            assert g == w


# what Inductor raises on a CPU worker where no C++ toolchain can build its kernels
NO_TOOLCHAIN = ("CppCompileError", "InvalidCxxCompiler", "Python.h")


@pytest.mark.skipif(HOME_DEVICE.type != "cuda" and shutil.which("g++") is None,
                    reason="Inductor compiles C++ for CPU workers: no C++ compiler here")
def test_inductors_numbers_agree_within_rounding(monkeypatch):
    monkeypatch.setenv("GTMPI_COMPILE", "0")
    plain_losses, plain_weights, _, _ = _loop("1", monkeypatch, _adamw, 6)
    monkeypatch.setenv("GTMPI_COMPILE", "1")
    losses, weights, _, _ = _loop("1", monkeypatch, _adamw, 6)
    notes = _explained()
    if HOME_DEVICE.type != "cuda" and any(w in notes for w in NO_TOOLCHAIN):
        pytest.skip("Inductor could not build C++ kernels on this machine: " +
                    next(line for line in notes.splitlines() if "not compiled" in line))
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for key, w in plain_weights.items():
        assert torch.allclose(weights[key], w, rtol=1e-3, atol=1e-3), key
    assert "(compiled by Inductor in" in _explained()


@pytest.mark.skipif(HOME_DEVICE.type == "cuda", reason="auto compiles on GPU workers")
def test_auto_compiles_nothing_on_cpu_workers(monkeypatch):
    monkeypatch.setenv("GTMPI_COMPILE", "auto")
    before = _compiles()
    _loop("1", monkeypatch, _adamw, 5)
    assert _compiles() == before  # none compiled, none refused


@pytest.mark.skipif(HOME_DEVICE.type != "cuda" and shutil.which("g++") is None,
                    reason="Inductor compiles C++ for CPU workers: no C++ compiler here")
def test_inductor_compiles_dropout_and_attentions_dropout_and_draws_alike_run_after_run(
        monkeypatch):
    """The counted draws as Inductor compiles them (it once refused them: it bounded the index
    times splitmix's constant as an indexing expression, past int64)."""
    monkeypatch.setenv("GTMPI_COMPILE", "1")
    F = gtmpi.nn.functional

    def run() -> list[torch.Tensor]:
        gtmpi.manual_seed(7)
        gen = torch.Generator().manual_seed(5)
        q, k, v = (gtmpi.tensor(torch.randn(2, 2, 8, 4, generator=gen)).requires_grad_()
                   for _ in range(3))

        @gtmpi.replayable
        def step(q, k, v):
            out = F.dropout(F.scaled_dot_product_attention(q, k, v, dropout_p=0.3,
                                                           is_causal=True), 0.2)
            out.sum().backward()
            return out.detach()
        outs = []
        for _ in range(5):
            q.grad = k.grad = v.grad = None
            outs.append(step(q, k, v).cpu_torch())
        return outs + [q.grad.cpu_torch()]

    before = _compiles()
    first = run()
    notes = _explained()
    if HOME_DEVICE.type != "cuda" and any(w in notes for w in NO_TOOLCHAIN):
        pytest.skip("Inductor could not build C++ kernels on this machine")
    assert tuple(a - b for a, b in zip(_compiles(), before)) == (1, 0), notes
    again = run()
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[-2], first[-3])  # each call its own masks


@pytest.mark.parametrize("mode", ["fx", "1"])
def test_a_growing_call_compiles_once_for_every_size_and_draws_as_written(mode, monkeypatch):
    """A decoding loop's growing program (one program, its sizes following the sequence's
    length) is traced once with the length as a symbol and compiled for every length: each
    later call runs it compiled, with no CUDA graph, and every token drawn is the one drawn
    as written."""
    if mode == "1" and HOME_DEVICE.type != "cuda" and shutil.which("g++") is None:
        pytest.skip("Inductor compiles C++ for CPU workers: no C++ compiler here")
    model, written = _decoder_as_written(monkeypatch)
    monkeypatch.setenv("GTMPI_COMPILE", mode)
    before = _compiles()
    stats = gtmpi.debug.worker_stats().values()
    ran, unfit = (sum(s[k] for s in stats) for k in ("sized_compiled", "sized_unfit"))
    for _ in range(2):
        assert torch.equal(_generate(model, 11), written)
    notes = _explained()
    # (the sampling between the calls is refused: it draws by multinomial)
    assert _compiles()[0] - before[0] == 1, notes
    how = "Inductor" if mode == "1" else "its traced graph (GTMPI_COMPILE=fx)"
    assert "replayed compiled, no CUDA graph: its sizes follow its call's" in notes, notes
    assert f"(compiled by {how} for every size in" in notes, notes
    # compiled at t = 6 (t = 2, 3, 4 are samples, t = 5 a replay op by op): t = 6 .. 11 of the
    # first loop and t = 2 .. 11 of the second ran compiled; t = 1 of the second ran op by op,
    # as the trace assumed n >= 2 (a size of 1 broadcasts)
    stats = gtmpi.debug.worker_stats().values()
    assert sum(s["sized_compiled"] for s in stats) - ran == 6 + 10
    assert sum(s["sized_unfit"] for s in stats) - unfit == 1
    assert "assuming 2 <= n of the growing size" in notes, notes


def test_a_growing_program_that_cannot_be_compiled_runs_op_by_op_and_says_why(monkeypatch):
    """GTMPI_COMPILE=auto on CPU workers: the growing program is refused with its reason (as
    written, the samples are the same)."""
    if HOME_DEVICE.type == "cuda":
        pytest.skip("auto compiles on GPU workers")
    model, written = _decoder_as_written(monkeypatch)
    monkeypatch.setenv("GTMPI_COMPILE", "auto")
    assert torch.equal(_generate(model, 11), written)
    assert "not compiled: worker rank 1: GTMPI_COMPILE=auto compiles nothing on a CPU " \
        "worker" in _explained()


def test_which_inputs_grow_is_read_off_two_sizes():
    """growth(): each input whose sizes or strides changed between two calls gets a * n + b
    for each; an input whose size is no whole linear function of n refuses the program."""
    from gtmpi.worker.compiled import growth
    was = (4, {1: ((1, 4), (4, 1)), 2: ((8, 8), (8, 1))})
    assert growth(was, 6, {1: ((1, 6), (6, 1)), 2: ((8, 8), (8, 1))}) == \
        {1: (((0, 1), (1, 0)), ((1, 0), (0, 1)))}
    assert growth(was, 6, {1: ((1, 7), (7, 1)), 2: ((8, 8), (8, 1))}) == \
        "a size or stride of input 1 is no linear function of n"
    assert growth(was, 4, {1: ((1, 4), (4, 1)), 2: ((8, 8), (8, 1))}) == \
        "its inputs were not seen at two sizes"


@pytest.mark.parametrize("mode, device, asked, warms", [
    ("1", "cpu", False, True), ("auto", "cpu", False, False), ("auto", "cuda", False, True),
    ("0", "cuda", False, False), ("fx", "cpu", False, False), ("1", "meta", False, False),
    (None, "cuda", False, False), ("asked", "cuda", False, False),
    ("asked", "cuda", True, True), ("asked", "cpu", True, False)])
def test_a_worker_that_will_compile_warms_the_compiler_up_meanwhile(mode, device, asked, warms,
                                                                     monkeypatch):
    """Where GTMPI_COMPILE asks a worker to compile (at its start), or a program given to
    gtmpi.compile will under GTMPI_COMPILE=asked (``asked``: rank 0 says so then), a thread
    pays tracing's and Inductor's first-use costs on a tiny program (the worker joins it
    before its first capture); nowhere else."""
    from gtmpi.worker import compiled as compiling
    if mode is None:
        monkeypatch.delenv("GTMPI_COMPILE", raising=False)
    else:
        monkeypatch.setenv("GTMPI_COMPILE", mode)
    started = []
    monkeypatch.setattr(compiling.threading.Thread, "start", lambda t: started.append(t))
    thread = compiling.warm_up(torch.device(device), asked)
    assert (thread is not None) == warms and len(started) == warms
    if warms:
        assert thread.name == "gtmpi-compile-warm-up" and thread.daemon


def test_a_module_given_to_compile_asks_its_forward_and_backward_compiled(monkeypatch):
    """torch.compile(model)'s place: under GTMPI_COMPILE=asked (to be the default once run on
    a GPU), the programs a module given to gtmpi.compile records (its forward and backward)
    ask to be compiled where that wins ('auto': Inductor on GPU workers, nothing on CPU
    workers), the clipping's and the optimizer's do not; the other settings decide for every
    program alike, and unset nothing compiles."""
    from gtmpi.dispatcher.dispatcher import compile_mode
    monkeypatch.setenv("GTMPI_COMPILE", "asked")
    warmed = []
    post = runtime().dispatcher.post
    monkeypatch.setattr(runtime().dispatcher, "post", lambda word, args, ranks: (
        warmed.append((word, ranks)), post(word, args, ranks)))
    before = _compiles()
    losses, _, model, _ = _loop("1", monkeypatch, _adamw, 6, compiled=True)
    assert ("warm_compile", sorted(runtime().dispatcher.links)) in warmed
    compiled, refused = (a - b for a, b in zip(_compiles(), before))
    plain, _, plain_model, _ = _loop("1", monkeypatch, _adamw, 6)
    assert losses == plain  # a mark that changes no result
    call, = [c for kept in model._capture.kept.values() for c in kept]
    programs = [call.program] + [b.program for b in call.backwards.values()]
    assert len(programs) == 2 and [compile_mode(p) for p in programs] == ["auto", "auto"]
    other, = [c for kept in plain_model._capture.kept.values() for c in kept]
    assert compile_mode(other.program) == ""
    if HOME_DEVICE.type == "cuda":
        assert compiled >= 2 and refused == 0, _explained()
    else:
        assert (compiled, refused) == (0, 0)
    for value, mode in (("0", ""), ("1", "inductor"), ("fx", "fx"), (None, "")):
        if value is None:
            monkeypatch.delenv("GTMPI_COMPILE")
        else:
            monkeypatch.setenv("GTMPI_COMPILE", value)
        assert compile_mode(programs[0]) == compile_mode(other.program) == mode


def test_auto_leaves_attention_with_dropout_uncompiled_and_says_why():
    """Compiled, attention with dropout is composed (its mask drawn by counting) and keeps
    its probabilities: as fast as the fused kernel and 1.35x the memory (nanoGPT's first run
    on an H100), so auto's rule does not compile it; asked plainly (1), it does."""
    from gtmpi.ops.table import Seed
    from gtmpi.worker import compiled as compiling
    attention = [("scaled_dot_product_attention", 4, (1, 2, 3, None, 0.2, True, None, Seed(9, 0)),
                  0b111, None)]
    assert compiling.refusal(attention) is None
    assert "leaves attention with dropout to its fused kernel" in \
        compiling.refusal(attention, "auto")
    plain = [("scaled_dot_product_attention", 4, (1, 2, 3, None, 0.0, True, None), 0b111, None)]
    assert compiling.refusal(plain, "auto") is None


def test_an_unknown_compile_mode_is_named(monkeypatch):
    monkeypatch.setenv("GTMPI_COMPILE", "fast")
    with pytest.raises(ValueError, match="GTMPI_COMPILE='fast': one of 0, 1, auto, asked, fx"):
        _loop("1", monkeypatch, _adamw, 4)
    runtime()  # the session goes on


TRAINED = """
    import io, sys
    sys.path.insert(0, {tests!r})
    import torch
    import gtmpi
    from test_capture import _gpt

    def loop(seq):
        gtmpi.manual_seed(3)
        c, model = _gpt()
        opt = gtmpi.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(5):
            data = torch.randint(0, c.vocab, (4, seq + 1), generator=gen)
            loss = model(gtmpi.tensor(data[:, :-1]), gtmpi.tensor(data[:, 1:]))
            loss.backward()
            gtmpi.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        print("LOSSES", losses, [p.cpu_torch().sum().item() for p in model.parameters()])
        return c

    c = loop(int(sys.argv[1]))
    if len(sys.argv) > 2:  # the same model on shorter sequences: other shapes, another trace
        loop(c.seq - 2)
    out = io.StringIO()
    gtmpi.debug.explain(file=out)
    print(out.getvalue())
"""


@pytest.mark.skipif(len(gtmpi.info()["workers"]) > 1, reason="runs plain python jobs itself")
def test_a_second_run_reads_its_programs_traces_from_disk_and_gives_the_same_numbers(tmp_path):
    """GTMPI_COMPILE=fx (the trace run as it is), a training loop run twice in two processes
    with one cache folder: the second run's forward, backward and clipping programs are read
    from disk, not traced (its backward reads the forward's records, their functions kept by
    name), and it gives the first run's losses and weights bit for bit; a program of other
    shapes in it is traced; GTMPI_TRACE_CACHE=0 keeps nothing."""
    tests = os.path.dirname(os.path.abspath(__file__))
    seq = str(SIZES["tiny"].seq)
    env = {"GTMPI_COMPILE": "fx", "GTMPI_CAPTURE": "1", "GTMPI_CUDA_GRAPHS": GRAPHS,
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    body = TRAINED.format(tests=tests)
    runs = [run_job(tmp_path, body, 240, n=None, env=env, args=args)[0]
            for args in ([seq], [seq, "more"])]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = ([l for l in p.stdout.splitlines() if l.startswith("LOSSES")] for p in runs)
    assert len(first) == 1 and len(second) == 2 and second[0] == first[0], (first, second)
    read = [l for l in runs[1].stdout.splitlines() if "its trace read from disk" in l]
    assert len(read) >= 3 and any("backward" in l for l in read), runs[1].stdout
    assert not any("its trace read from disk" in l for l in runs[0].stdout.splitlines())
    # the shorter sequences' forward and backward were traced afresh
    assert sum("(traced in" in l for l in runs[1].stdout.splitlines()) >= 2, runs[1].stdout
    kept = list((tmp_path / "cache" / "gtmpi-traces").rglob("*.pickle"))
    assert kept and not list((tmp_path / "cache").rglob(".writing-*"))
    off = run_job(tmp_path, body, 240, n=None, args=[seq],
                  env={**env, "GTMPI_TRACE_CACHE": "0",
                       "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "off")})[0]
    assert off.returncode == 0 and "LOSSES" in off.stdout, off.stderr[-3000:]
    assert not (tmp_path / "off" / "gtmpi-traces").exists()


def test_a_trace_file_that_cannot_be_read_is_traced_again(tmp_path, monkeypatch):
    from gtmpi.worker import tracecache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    found_by = tracecache.key(("program", 1, [2.5, None]))
    assert found_by == tracecache.key(("program", 1, [2.5, None]))
    assert found_by != tracecache.key(("program", 1, [2.5, 0]))
    assert tracecache.load(found_by) is None
    assert tracecache.store(found_by, {"graph": [1, 2]}) == {"graph": [1, 2]}
    assert tracecache.load(found_by) == {"graph": [1, 2]}
    path, = tmp_path.rglob("*.pickle")
    path.write_bytes(path.read_bytes()[:7])  # cut short, as a full disk might leave it
    assert tracecache.load(found_by) is None
    assert tracecache.key(lambda: 0) is None  # no pickle takes it: traced every time
