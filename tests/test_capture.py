"""Module calls captured (GTMPI_CAPTURE=1, nn/capture.py): an outermost module call whose key
matches a recorded one runs its recorded forward program, and its backward one node's
recorded backward program, with the numbers of running the Python as written; every change a
stale capture would get wrong is seen by the guard; what cannot be captured runs as written
and says why."""
from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

import gtmpi
import gtmpi.nn as nn
import gtmpi.nn.functional as F
from gtmpi.client.runtime import runtime

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.gpt.model import SIZES, build  # noqa: E402


@pytest.fixture(autouse=True)
def captured(monkeypatch):
    monkeypatch.setenv("GTMPI_CAPTURE", "1")


def _notes(model) -> dict:
    """How the model's outermost calls ran so far (replayed, or as written and why)."""
    return dict(runtime().capture_notes[model._capture.name])


def _gpt(dropout: float = 0.0):
    c = SIZES["tiny"]
    torch.manual_seed(0)
    ref = build(torch)(c)
    model = build(gtmpi)(c)
    model.load_state_dict(ref.state_dict())
    if dropout:  # after each block (the example's GPT has no dropout of its own)
        for block in model.blocks:
            block.drop = nn.Dropout(dropout)
            block.register_forward_hook(lambda m, args, out: m.drop(out))
    return c, model


def _loop(capture: str, monkeypatch, make_opt, steps: int, dropout: float = 0.0,
          schedule: bool = False, clip: float = 1.0, change=None, compiled: bool = False):
    """The tiny GPT trained ``steps`` steps, clipped; ``schedule``: its rate changes every step;
    ``change(model, opt)`` runs before the fifth; ``compiled``: the model given to
    gtmpi.compile. Its losses, weights, model and optimizer."""
    monkeypatch.setenv("GTMPI_CAPTURE", capture)
    gtmpi.manual_seed(3)
    c, model = _gpt(dropout)
    if compiled:
        assert gtmpi.compile(model) is model
    opt = make_opt(model.parameters())
    gen = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        if schedule:
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (0.5 + 0.5 * i / steps)
        data = torch.randint(0, c.vocab, (4, c.seq + 1), generator=gen)
        if change is not None and i == 4:
            change(model, opt)
        loss = model(gtmpi.tensor(data[:, :-1]), gtmpi.tensor(data[:, 1:]))
        loss.backward()
        gtmpi.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    weights = {k: p.cpu_torch() for k, p in model.named_parameters()}
    return losses, weights, model, opt


def _train(capture: str, monkeypatch, steps: int = 6, dropout: float = 0.0):
    losses, weights, model, _ = _loop(capture, monkeypatch,
                                      lambda p: gtmpi.optim.AdamW(p, lr=1e-2), steps, dropout)
    return losses, weights, model


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_captured_training_loop_gives_the_numbers_as_written(monkeypatch, dropout):
    written, weights_written, _ = _train("0", monkeypatch, dropout=dropout)
    losses, weights, model = _train("1", monkeypatch, dropout=dropout)
    assert losses == written  # bit for bit: the same kernels, the same seeds
    for k in weights_written:
        torch.testing.assert_close(weights[k], weights_written[k], rtol=0, atol=0, msg=k)
    notes = _notes(model)
    assert notes == {"as written: warm-up": 1, "as written: recorded": 1, "replayed": 4}


def _steps(capture: str, monkeypatch, make_opt, steps: int = 6, change=None):
    """A loop whose rate changes every step (a schedule), clipped: losses, weights, the
    optimizer's state as saved, and the notes of its step and its clip."""
    losses, weights, _, opt = _loop(capture, monkeypatch, make_opt, steps, schedule=True,
                                    clip=0.5, change=change)
    notes = {name.split(" (")[0]: dict(n) for name, n in runtime().capture_notes.items()
             if name.startswith((f"{type(opt).__name__}.step", "clip_grad_norm_"))}
    return losses, weights, opt.state_dict(), notes


_OPTIMIZERS = {
    "adamw": lambda params: gtmpi.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adam-foreach": lambda params: gtmpi.optim.Adam(params, lr=1e-2, fused=False),
    "sgd-momentum": lambda params: gtmpi.optim.SGD(params, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("kind", _OPTIMIZERS)
def test_the_optimizer_step_and_the_clip_replay_with_each_steps_rate(monkeypatch, kind):
    written, weights_written, state_written, _ = _steps("0", monkeypatch, _OPTIMIZERS[kind])
    runtime().capture_notes.clear()
    runtime().repeated.clear()  # an earlier test's clip at this line: counted afresh
    losses, weights, state, notes = _steps("1", monkeypatch, _OPTIMIZERS[kind])
    assert losses == written  # bit for bit: each replay got its step's rate and count
    for k in weights_written:
        torch.testing.assert_close(weights[k], weights_written[k], rtol=0, atol=0, msg=k)
    host = lambda v: v.cpu_torch() if isinstance(v, gtmpi.Tensor) else torch.as_tensor(v)
    for i, entry in state_written["state"].items():
        for k, v in entry.items():  # the step counts too, which the client keeps
            torch.testing.assert_close(host(state["state"][i][k]), host(v), rtol=0, atol=0)
    # the first step makes the state (moments, momentum buffers): its key is one of its own
    step = f"{_OPTIMIZERS[kind]([gtmpi.zeros(1)]).__class__.__name__}.step"
    assert notes[step] == {"as written: warm-up": 2, "as written: recorded": 1, "replayed": 3}
    assert notes["clip_grad_norm_"] == {"as written: warm-up": 1, "as written: recorded": 1,
                                        "replayed": 4}


def test_a_subclass_of_an_optimizer_steps_as_written_and_says_why(monkeypatch):
    class Mine(gtmpi.optim.AdamW):  # its step could do anything besides the update
        pass
    runtime().capture_notes.clear()
    runtime().repeated.clear()
    written, weights_written, _, _ = _steps("0", monkeypatch, lambda p: Mine(p, lr=1e-2))
    losses, weights, _, notes = _steps("1", monkeypatch, lambda p: Mine(p, lr=1e-2))
    assert losses == written
    assert notes["Mine.step"] == {"as written: a subclass of gtmpi's optimizers": 6}


def _set(group_key, value):
    def change(model, opt):
        opt.param_groups[-1][group_key] = value
    return change


def _frozen(model, opt):
    model.head.weight.requires_grad_(False)  # no gradient from here on: updated no more


def _reloaded(model, opt):
    opt.load_state_dict(opt.state_dict())  # new state tensors, the same numbers


def _regrouped(model, opt):
    opt.param_groups = [dict(g) for g in opt.param_groups]  # new group dicts


def _replaced(model, opt):
    with gtmpi.no_grad():
        model.head.weight.data = model.head.weight.data * 0.5  # another tensor


_STEP_CHANGES = {"weight_decay": _set("weight_decay", 0.5), "betas": _set("betas", (0.8, 0.9)),
                 "eps": _set("eps", 1e-3), "frozen": _frozen, "reloaded": _reloaded,
                 "regrouped": _regrouped, "data replaced": _replaced}


@pytest.mark.parametrize("change", _STEP_CHANGES)
def test_every_change_an_optimizer_step_reads_gives_the_result_as_written(monkeypatch, change):
    runs = []
    for capture in ("0", "1"):
        runtime().capture_notes.clear()
        runtime().repeated.clear()
        runs.append(_steps(capture, monkeypatch, _OPTIMIZERS["adamw"], steps=8,
                           change=_STEP_CHANGES[change]))
    (written, weights_written, _, _), (losses, weights, _, notes) = runs
    assert losses == written
    for k in weights_written:
        torch.testing.assert_close(weights[k], weights_written[k], rtol=0, atol=0, msg=k)
    assert notes["AdamW.step"]["replayed"] >= 2  # before the change and after it


def test_a_weight_replaced_between_a_captured_forward_and_its_backward_is_an_error(monkeypatch):
    c, model = _gpt()
    data = torch.randint(0, c.vocab, (4, c.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = gtmpi.tensor(data[:, :-1]), gtmpi.tensor(data[:, 1:])
    for _ in range(3):  # warm-up, recorded, replayed
        loss = model(x, y)
        loss.backward()
    loss = model(x, y)
    with gtmpi.no_grad():
        model.head.weight.data = model.head.weight.data * 0.5
    with pytest.raises(RuntimeError, match="replaced or freed between its forward and this"):
        loss.backward()


def test_the_guard_walks_the_model_only_when_it_changed(monkeypatch):
    _, _, model = _train("1", monkeypatch, steps=5)
    assert model._capture.guard.walks == 1  # then checks only: the model did not change
    model.train()  # a change: walked again, the same answer, so replays go on
    c = SIZES["tiny"]
    x = gtmpi.tensor(torch.randint(0, c.vocab, (4, c.seq)))
    model(x, x).backward()
    assert model._capture.guard.walks == 2 and _notes(model)["replayed"] == 4


def test_capture_is_the_default_where_one_worker_runs_the_program(monkeypatch):
    """GTMPI_CAPTURE unset (auto): a job of one worker captures (the case run on a GPU), one
    of several runs as written unless GTMPI_CAPTURE=1 asks."""
    monkeypatch.delenv("GTMPI_CAPTURE")
    c, model = _gpt()
    x = gtmpi.tensor(torch.randint(0, c.vocab, (4, c.seq)))
    for _ in range(3):  # warm-up, recorded, replayed
        model(x, x).backward()
    if len(runtime().workers) == 1:
        assert _notes(model)["replayed"] == 1
    else:
        assert "_capture" not in model.__dict__


def test_a_captured_model_deleted_frees_its_workers_tensors_at_once(monkeypatch):
    """A module keeps its capture and the capture its guard: were the guard to hold the module
    back, deleting a model would free its workers' memory only when the garbage collector ran
    (a model replaced by another in one process would hold two on the GPU)."""
    import gc

    def held() -> int:
        gtmpi.synchronize()
        return sum(s["tensors"] for s in gtmpi.debug.worker_stats().values())

    before = held()
    c, model = _gpt()
    x = gtmpi.tensor(torch.randint(0, c.vocab, (4, c.seq)))
    for _ in range(3):  # warm-up, recorded, replayed
        model(x, x).backward()
    assert _notes(model)["replayed"] == 1
    assert held() > before + len(list(model.parameters()))
    gc.disable()
    try:
        del model
        assert held() <= before + 2  # x and at most the last loss's
    finally:
        gc.enable()


def test_evaluation_under_no_grad_has_its_own_key(monkeypatch):
    c, model = _gpt()
    gen = torch.Generator().manual_seed(2)
    batches = [gtmpi.tensor(torch.randint(0, c.vocab, (4, c.seq), generator=gen))
               for _ in range(3)]
    expected = []
    monkeypatch.setenv("GTMPI_CAPTURE", "0")
    model.eval()
    with gtmpi.no_grad():
        expected = [model(x, x).item() for x in batches for _ in range(2)]
    monkeypatch.setenv("GTMPI_CAPTURE", "1")
    got = []
    for x in batches:
        model.train()
        model(x, x).backward()  # the training key, between evaluations
        model.eval()
        with gtmpi.no_grad():
            got += [model(x, x).item() for _ in range(2)]
    assert got == expected
    notes = _notes(model)
    # training: warm-up, recorded, replayed; evaluation: warm-up, recorded, 4 replayed
    assert notes["replayed"] == 5 and notes["as written: recorded"] == 2


class _Scaled(nn.Module):
    """A forward that reads what each guard kind follows."""

    FACTOR = 1.0  # a class attribute, read as self.FACTOR

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 1.0
        self.offsets = [0.0]
        self.config = _Config()

    def forward(self, x):
        y = self.lin(x) * self.scale * self.FACTOR * SCALE * self.config.gain + \
            self.offsets[-1] + self.config.shift
        return F.dropout(y, 0.5, self.training)


class _Config:
    shift = 0.0  # a default the instance does not set (a dataclass field's)

    def __init__(self) -> None:
        self.gain = 1.0


SCALE = 1.0


def _each_change():
    """(what it changes, the change): each makes the next call's result differ."""
    def attribute(m):
        m.scale = 3.0

    def class_attribute(m):
        _Scaled.FACTOR = 5.0

    def global_rebound(m):
        global SCALE
        SCALE = 7.0

    def list_appended(m):
        m.offsets.append(11.0)

    def object_field(m):
        m.config.gain = 13.0

    def object_class_default(m):
        _Config.shift = 23.0

    def eval_mode(m):
        m.eval()

    def weight_replaced(m):
        m.lin.weight = nn.Parameter(gtmpi.ones(4, 4))

    def layer_frozen(m):
        m.lin.weight.requires_grad_(False)

    def data_replaced(m):  # the same Parameter object, another storage
        m.lin.weight.data = gtmpi.full((4, 4), 0.5)

    def hook_added(m):
        m.lin.register_forward_hook(lambda mod, args, out: out * 17.0)

    def pre_hook_added(m):
        m.lin.register_forward_pre_hook(lambda mod, args: (args[0] * 19.0,))

    def submodule_swapped(m):
        m.lin = nn.Linear(4, 4)

    return [attribute, class_attribute, global_rebound, list_appended, object_field,
            object_class_default, eval_mode,
            weight_replaced, layer_frozen, data_replaced, hook_added, pre_hook_added,
            submodule_swapped]


@pytest.mark.parametrize("change", _each_change(), ids=lambda f: f.__name__)
def test_every_guard_kind_gives_the_result_as_written(monkeypatch, change):
    global SCALE
    results = {}
    for capture in ("0", "1"):
        monkeypatch.setenv("GTMPI_CAPTURE", capture)
        SCALE, _Scaled.FACTOR, _Config.shift = 1.0, 1.0, 0.0
        gtmpi.manual_seed(5)
        torch.manual_seed(5)
        m = _Scaled()
        x = gtmpi.tensor(torch.randn(2, 4))
        outs = []
        for i in range(6):
            if i == 4:
                change(m)
            y = m(x)
            if m.lin.weight.requires_grad and gtmpi.is_grad_enabled():
                y.sum().backward()
                outs.append(m.lin.weight.grad.cpu_torch().clone())
                m.lin.weight.grad = None
            else:
                outs.append(None)
            outs.append(y.cpu_torch())
        results[capture] = outs
        if capture == "1":
            assert _notes(m).get("replayed", 0) >= 1  # captured before the change
    SCALE, _Scaled.FACTOR, _Config.shift = 1.0, 1.0, 0.0
    for a, b in zip(results["0"], results["1"]):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert not torch.equal(results["1"][-1], results["1"][7])  # the change changed the result


_STASH: set = set()


class _Keeps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        _STASH.add(y * 2)  # kept where no result or graph holds it
        return y


class _Reads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + next(iter(_HIDDEN))  # a tensor held in a set: no walk looks


_HIDDEN: set = set()


class _Dict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return {"out": self.lin(x)}


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return gtmpi.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=False)


def _fallbacks():
    return [
        ("an argument requires grad", lambda: nn.Linear(4, 4),
         lambda: gtmpi.randn(2, 4, requires_grad=True)),
        ("it returned a dict", _Dict, lambda: gtmpi.randn(2, 4)),
        ("its forward kept 1 tensor(s) outside its results", _Keeps, lambda: gtmpi.randn(2, 4)),
        ("activation checkpointing (or a custom Function) inside", _Checkpointed,
         lambda: gtmpi.randn(2, 4)),
        ("it read a tensor from before that no guard follows", _Reads,
         lambda: gtmpi.randn(2, 4)),
    ]


@pytest.mark.parametrize("why, make, arg", _fallbacks(), ids=lambda v: v if isinstance(v, str)
                         else None)
def test_what_cannot_be_captured_runs_as_written_and_says_why(why, make, arg):
    _HIDDEN.clear()
    _HIDDEN.add(gtmpi.ones(4))
    m = make()
    results = []
    for _ in range(4):
        x = arg()
        y = m(x)
        y = y["out"] if isinstance(y, dict) else y
        y.sum().backward()
        results.append(y.cpu_torch())
    notes = _notes(m)
    assert "replayed" not in notes
    assert any(k.startswith(f"as written: {why}") for k in notes), notes
    out = io.StringIO()
    gtmpi.debug.explain(out)
    assert f"captured {m._capture.name}: " in out.getvalue() and why in out.getvalue()


def test_a_model_without_capture_is_untouched(monkeypatch):
    monkeypatch.setenv("GTMPI_CAPTURE", "0")
    m = nn.Linear(4, 4)
    for _ in range(3):
        m(gtmpi.randn(2, 4))
    assert "_capture" not in m.__dict__


class _Decoder(nn.Module):
    """nanoGPT's decoder in small: positions by arange(t), heads by view(b, t, h, d), the
    last position's logits; ``square`` adds a size that is no linear function of t."""

    def __init__(self, square: bool = False) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(11, 8), nn.Embedding(16, 8)
        self.head = nn.Linear(8, 11)
        self.square = square

    def forward(self, idx):
        b, t = idx.size()
        x = self.emb(idx) + self.pos(gtmpi.arange(0, t, dtype=torch.long))
        x = x.view(b, t, 2, 4).transpose(1, 2).transpose(1, 2).reshape(b, t, 8)
        if self.square:
            x = x + gtmpi.ones(t * t)[:t].view(1, t, 1)
        return self.head(x[:, [-1], :])


def _generate(model, steps: int, block: int = 12):
    """nanoGPT's generate: the sequence a token longer each call, cropped at ``block``."""
    gtmpi.manual_seed(5)
    idx = gtmpi.zeros(1, 1, dtype=torch.long)
    with gtmpi.no_grad():
        for _ in range(steps):
            cond = idx if idx.size(1) <= block else idx[:, -block:]
            probs = F.softmax(model(cond)[:, -1, :], dim=-1)
            idx = gtmpi.cat((idx, gtmpi.multinomial(probs, num_samples=1)), dim=1)
    return idx.cpu_torch()


def _decoder_as_written(monkeypatch, steps: int = 11):
    """A _Decoder and what _generate draws with it as written (no crop at 11 steps: each call
    a new length); capture on from then on."""
    gtmpi.manual_seed(0)
    model = _Decoder()
    monkeypatch.setenv("GTMPI_CAPTURE", "0")
    written = _generate(model, steps)
    monkeypatch.setenv("GTMPI_CAPTURE", "1")
    return model, written


@pytest.mark.parametrize("square", [False, True], ids=["linear", "square"])
def test_a_growing_sequence_replays_one_program_with_its_sizes(monkeypatch, square):
    """A decoding loop without a KV cache calls the model a token longer each time: after
    samples at three sizes it replays one program whose sizes follow the length (no Python
    run), then records the cropped length as it is; a size that is no linear function of the
    length is refused, and every call runs as written."""
    gtmpi.manual_seed(0)
    model = _Decoder(square)
    monkeypatch.setenv("GTMPI_CAPTURE", "0")
    written = _generate(model, 20)
    monkeypatch.setenv("GTMPI_CAPTURE", "1")
    got = _generate(model, 20)
    assert torch.equal(got, written)
    notes = _notes(model)
    assert notes["as written: recorded (a growing size)"] == 3  # t = 2, 3, 4 (t = 1 warms up)
    if square:  # then as before: each new length runs as written, the crop's is recorded
        assert "replayed (a growing size)" not in notes
        assert notes["as written: a growing size: its sizes are no linear function of the "
                     "growing one"] == 1
        assert notes["as written: warm-up"] == 1 + 8 and notes["replayed"] == 7
    else:  # t = 5 .. 12 and 12 once more; then 12 is recorded as it is, and replayed
        assert notes["as written: warm-up"] == 1 and notes["replayed (a growing size)"] == 9
        assert notes["as written: recorded"] == 1 and notes["replayed"] == 6
    out = io.StringIO()
    gtmpi.debug.explain(out)
    assert f"captured {model._capture.name}: " in out.getvalue()


def test_each_size_of_a_growing_call_becomes_a_cuda_graph_of_its_own(monkeypatch):
    """Sampled again, a growing call's sizes come round again: each is captured at its second
    replay, as a repeated step is, and launched from its third (the stand-in backend here);
    every sample is the one drawn as written."""
    gtmpi.manual_seed(0)
    model = _Decoder()
    monkeypatch.setenv("GTMPI_CAPTURE", "0")
    written = _generate(model, 20)
    monkeypatch.setenv("GTMPI_CAPTURE", "1")
    monkeypatch.setenv("GTMPI_CUDA_GRAPHS", "emulate")
    monkeypatch.setenv("GTMPI_SIZED_GRAPHS", "1")
    launches = []
    for _ in range(3):
        assert torch.equal(_generate(model, 20), written)
        stats = gtmpi.debug.worker_stats()
        launches.append(sum(s["graph_launches"] for s in stats.values()))
    # t = 5 .. 12 and 12 once more in the first; t = 2 .. 12 in each later one (t = 1 is
    # its own key, replayed as it is)
    assert _notes(model)["replayed (a growing size)"] == 9 + 2 * 11
    notes = [note for name, note in runtime().dispatcher.graph_notes.items()
             if name.startswith(f"{model._capture.name} for every size (recorded at")]
    assert notes == [f"a CUDA graph per size (12 of 12 sizes) on worker(s) {runtime().dispatcher.home}"]
    assert launches[2] - launches[1] >= 11  # sizes 2 .. 12, besides the sampler's own graphs
