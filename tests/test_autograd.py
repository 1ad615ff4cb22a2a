"""Gradients of every differentiable op against torch.autograd on random inputs, the graph
semantics (independent graphs, accumulation, retain_graph, no_grad, detach), and the errors."""
from __future__ import annotations

import pytest
import torch

import gtmpi
from conftest import assert_same


def lib(t):
    return gtmpi if isinstance(t, gtmpi.Tensor) else torch


def grad_check(fn, *inputs, dtype=torch.float64, rtol=None, atol=None):
    """fn(*leaves) in torch and in gtmpi; the gradients of a random weighting of its outputs agree."""
    gen = torch.Generator().manual_seed(99)
    t_leaves = [x.detach().to(dtype).clone().requires_grad_() if x.is_floating_point() else x
                for x in inputs]
    t_out = fn(*t_leaves)
    t_outs = t_out if isinstance(t_out, tuple) else (t_out,)
    weights = [torch.rand(o.shape, generator=gen, dtype=o.dtype) if o.is_floating_point() else None
               for o in t_outs]
    sum(((o * w).sum() for o, w in zip(t_outs, weights) if w is not None)).backward()
    g_leaves = [gtmpi.tensor(x.detach(), requires_grad=x.requires_grad) for x in t_leaves]
    g_out = fn(*g_leaves)
    g_outs = g_out if isinstance(g_out, tuple) else (g_out,)
    for g, t in zip(g_outs, t_outs):
        assert_same(g, t.detach(), rtol=rtol, atol=atol)
    loss = sum(((o * gtmpi.tensor(w)).sum() for o, w in zip(g_outs, weights) if w is not None))
    loss.backward()
    for g, t in zip(g_leaves, t_leaves):
        if t.requires_grad:
            assert g.grad is not None, "no gradient reached a leaf"
            assert_same(g.grad, t.grad, rtol=rtol, atol=atol)


def r(*shape, low=-2.0, high=2.0, seed=[0]):
    seed[0] += 1
    g = torch.Generator().manual_seed(seed[0])
    return torch.rand(shape, generator=g, dtype=torch.float64) * (high - low) + low


BINARY = [
    ("add", lambda a, b: a + b), ("sub", lambda a, b: a - b), ("mul", lambda a, b: a * b),
    ("div", lambda a, b: a / b), ("mod", lambda a, b: a % b), ("pow", lambda a, b: abs(a) ** b),
    ("maximum", lambda a, b: lib(a).maximum(a, b)), ("minimum", lambda a, b: lib(a).minimum(a, b)),
    ("matmul", lambda a, b: a @ b.transpose(-1, -2)),
]


TOL = {torch.float64: {}, torch.float32: {"rtol": 1e-4, "atol": 1e-5}}


@pytest.mark.parametrize("dtype", TOL)
@pytest.mark.parametrize("name,fn", BINARY, ids=[b[0] for b in BINARY])
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((2, 3, 4), (3, 4)), ((3, 1), (1, 4))])
def test_binary_grads_with_broadcasting(name, fn, shapes, dtype):
    if name == "matmul" and shapes[0][-1] != shapes[1][-1]:
        shapes = ((3, 4), (5, 4))
    grad_check(fn, r(*shapes[0], low=0.5), r(*shapes[1], low=0.5, high=1.5), dtype=dtype, **TOL[dtype])


def test_scalar_operands_on_both_sides():
    grad_check(lambda x: (2.0 - x) * 3 + 1 / x - x ** 2 + 2 ** x, r(3, 4, low=0.5))


UNARY = [("exp", lambda x: x.exp()), ("log", lambda x: x.log()), ("sqrt", lambda x: x.sqrt()),
         ("rsqrt", lambda x: x.rsqrt()), ("sin", lambda x: x.sin()), ("cos", lambda x: x.cos()),
         ("tanh", lambda x: x.tanh()), ("sigmoid", lambda x: x.sigmoid()),
         ("relu", lambda x: x.relu()), ("abs", lambda x: abs(x)), ("neg", lambda x: -x),
         ("gelu", lambda x: lib(x).nn.functional.gelu(x) if lib(x) is torch else gtmpi.gelu(x)),
         ("gelu_tanh", lambda x: torch.nn.functional.gelu(x, approximate="tanh") if lib(x) is torch
          else gtmpi.gelu(x, approximate="tanh")),
         ("silu", lambda x: torch.nn.functional.silu(x) if lib(x) is torch else gtmpi.silu(x)),
         ("softmax", lambda x: x.softmax(-1)), ("log_softmax", lambda x: x.log_softmax(0)),
         ("clamp", lambda x: x.clamp(-0.5, 0.7)), ("clamp_min", lambda x: x.clamp(min=0.1)),
         ("to", lambda x: x.float() * 2)]


@pytest.mark.parametrize("dtype", TOL)
@pytest.mark.parametrize("name,fn", UNARY, ids=[u[0] for u in UNARY])
def test_unary_grads(name, fn, dtype):
    positive = name in ("log", "sqrt", "rsqrt")
    grad_check(fn, r(4, 5, low=0.2 if positive else -2), dtype=dtype, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grads_in_float32_and_float64(dtype):
    grad_check(lambda a, b: ((a @ b).tanh() * a.sum(1, keepdim=True)).mean(), r(3, 4), r(4, 2),
               dtype=dtype, rtol=1e-4 if dtype == torch.float32 else None,
               atol=1e-5 if dtype == torch.float32 else None)


REDUCTIONS = [
    ("sum", lambda x: x.sum()), ("sum_dim", lambda x: x.sum(1)), ("sum_keep", lambda x: x.sum((0, 2), keepdim=True)),
    ("mean", lambda x: x.mean(-1)), ("mean_all", lambda x: x.mean()),
    ("max_all", lambda x: x.max()), ("amax", lambda x: x.amax((0, 1))),
    ("max_dim", lambda x: x.max(dim=1)[0]), ("min_dim", lambda x: x.min(dim=2, keepdim=True).values),
    ("var", lambda x: x.var(1)), ("std", lambda x: x.std()), ("var_keep", lambda x: x.var((0, 2), keepdim=True, correction=0)),
]


@pytest.mark.parametrize("name,fn", REDUCTIONS, ids=[x[0] for x in REDUCTIONS])
def test_reduction_grads(name, fn):
    grad_check(fn, r(3, 4, 5))


SHAPE = [
    ("reshape", lambda x: x.reshape(4, 15) * 2), ("view", lambda x: x.view(-1)),
    ("permute", lambda x: x.permute(2, 0, 1)), ("transpose", lambda x: x.transpose(0, 2)),
    ("T", lambda x: x[0].T), ("squeeze", lambda x: x[:, :1].squeeze(1)), ("unsqueeze", lambda x: x.unsqueeze(1)),
    ("flatten", lambda x: x.flatten(1)), ("expand", lambda x: x[:, :, :1].expand(3, 4, 6)),
    ("contiguous", lambda x: x.transpose(0, 1).contiguous()),
    ("getitem", lambda x: x[1:, ::2, -1]), ("getitem_none", lambda x: x[None, 0, ..., 2]),
    ("getitem_int_tensor", lambda x: x[lib(x).tensor([0, 2, 0])]),
    ("getitem_mask", lambda x: x[x > 0]),
    ("split", lambda x: x.split([1, 3], dim=1)), ("split_some", lambda x: x.split(2, dim=2)[1]),
    ("chunk", lambda x: x.chunk(2, 0)),
]


@pytest.mark.parametrize("name,fn", SHAPE, ids=[x[0] for x in SHAPE])
def test_shape_and_index_grads(name, fn):
    grad_check(fn, r(3, 4, 5))


def test_cat_stack_where_grads():
    grad_check(lambda a, b: lib(a).cat([a, b, a], dim=1), r(2, 3), r(2, 4))
    grad_check(lambda a, b: lib(a).stack([a, b], dim=0), r(2, 3), r(2, 3))
    c = r(3, 4) > 0
    grad_check(lambda a, b, c: lib(a).where(c, a, b), r(3, 4), r(4), c)
    grad_check(lambda a, lo, hi: a.clamp(lo, hi), r(3, 4), r(4, low=-1, high=0), r(3, 1, low=0, high=1))


def test_independent_graphs_interleaved():
    """F0 F1 B0 B1 gives the gradients of F0 B0 F1 B1 (what a pipeline schedule relies on)."""
    w0 = torch.randn(4, 3, dtype=torch.float64)
    xs = [torch.randn(5, 4, dtype=torch.float64) for _ in range(2)]

    def run(order):
        w = gtmpi.tensor(w0, requires_grad=True)
        losses = {}
        grads = []
        for step in order:
            kind, i = step[0], int(step[1])
            if kind == "F":
                losses[i] = (gtmpi.tensor(xs[i]) @ w).tanh().sum()
            else:
                losses.pop(i).backward()
                grads.append(w.grad.cpu_torch().clone())
        return grads

    interleaved = run(["F0", "F1", "B0", "B1"])
    sequential = run(["F0", "B0", "F1", "B1"])
    for a, b in zip(interleaved, sequential):
        torch.testing.assert_close(a, b)


def test_grads_accumulate_until_reset_and_retain_graph():
    w = gtmpi.tensor([1.0, 2.0], requires_grad=True)
    loss = (w * w).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert w.grad.tolist() == [4.0, 8.0]
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    w.grad = None
    (w * 3).sum().backward()
    assert w.grad.tolist() == [3.0, 3.0]


def test_backward_with_gradient_argument():
    x = gtmpi.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y = x * x
    y.backward(gtmpi.tensor([1.0, 0.0, 2.0]))
    assert x.grad.tolist() == [2.0, 0.0, 12.0]
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        (x * 2).backward()


def test_no_grad_detach_is_leaf():
    x = gtmpi.ones(3, requires_grad=True)
    with gtmpi.no_grad():
        y = x * 2
    assert not y.requires_grad and y.is_leaf
    z = x * 2
    assert z.requires_grad and not z.is_leaf and x.is_leaf
    d = z.detach()
    assert not d.requires_grad and d.is_leaf
    assert d.tolist() == [2.0, 2.0, 2.0]

    @gtmpi.no_grad()
    def step():
        return x + 1
    assert not step().requires_grad
    assert not (x > 0).requires_grad            # comparisons are not differentiable
    assert not x.argmax().requires_grad
    values, indices = (x * 1).max(dim=0)
    assert values.requires_grad and not indices.requires_grad


def test_inplace_rules():
    x = gtmpi.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x += 1
    with gtmpi.no_grad():
        x -= 0.5                                 # optimizer-style update: allowed, not recorded
    assert x.tolist() == [0.5, 0.5, 0.5] and x.requires_grad and x.is_leaf


def test_repr_shows_grad_state_like_torch():
    t = torch.ones(2, 2, requires_grad=True)
    g = gtmpi.ones(2, 2, requires_grad=True)
    assert repr(g) == repr(t)
    assert repr((g * 2).sum()) == repr((t * 2).sum())


def test_requires_grad_errors_and_messages():
    with pytest.raises(RuntimeError, match="floating point"):
        gtmpi.arange(3).requires_grad_()
    with pytest.raises(RuntimeError, match="does not require grad"):
        gtmpi.ones(2).sum().backward()


def test_backward_moves_no_tensor_data_to_the_client():
    before = {r: s["bytes_sent"] for r, s in gtmpi.debug.worker_stats().items()}
    w = gtmpi.randn(64, 64, requires_grad=True)
    x = gtmpi.randn(32, 64)
    for _ in range(3):
        ((x @ w).relu() ** 2).mean().backward()
    gtmpi.synchronize()
    after = gtmpi.debug.worker_stats()
    assert all(after[r]["bytes_sent"] == before[r] for r in after)   # no reads happened
    assert w.grad.shape == (64, 64)


def test_print_tape_lists_the_current_graph_in_order():
    import io
    w = gtmpi.randn(3, 4, requires_grad=True)
    x = gtmpi.randn(5, 4)
    loss = (x @ w.T).tanh().sum()
    out = io.StringIO()
    gtmpi.debug.print_tape(file=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "autograd tape: 4 ops"
    assert [l.split()[1] for l in lines[1:]] == ["permute", "matmul", "tanh", "sum"]
    assert f"t{w.id} [3, 4] leaf" in lines[1] and f"t{loss.id} [] float32" in lines[4]
    loss.backward()
    out = io.StringIO()
    gtmpi.debug.print_tape(loss, file=out)
    assert out.getvalue().count("(freed by backward)") == 4
    out = io.StringIO()
    gtmpi.debug.print_tape(x, file=out)
    assert "has no autograd graph" in out.getvalue()


def test_accumulated_gradients_are_added_in_one_instruction(tmp_path):
    """A later backward adds the new gradients of leaves used once to their old ones with one
    foreach add (a pipeline does this for every micro-batch after the first), in torch's
    numbers; a weight used twice in the pass is still summed in order."""
    from gtmpi.recording import fileformat
    from gtmpi.recording.events import Kind, Lane
    from gtmpi.trace import analysis
    torch.manual_seed(3)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 6))
    model = gtmpi.nn.Sequential(gtmpi.nn.Linear(6, 5), gtmpi.nn.Tanh(), gtmpi.nn.Linear(5, 6))
    model.load_state_dict(ref.state_dict())
    xs = [torch.randn(4, 6) for _ in range(3)]

    def loss_of(lib, m, x):
        first = m[0](x)
        return (m(x)[:, :5] * first).sum()  # the first layer used twice in one pass

    for x in xs[:2]:
        loss_of(torch, ref, x).backward()
        loss_of(gtmpi, model, gtmpi.tensor(x)).backward()
    path = str(tmp_path / "accumulate.h5")
    gtmpi.synchronize()
    gtmpi.trace.start(path)
    loss_of(gtmpi, model, gtmpi.tensor(xs[2])).backward()
    gtmpi.trace.stop()
    loss_of(torch, ref, xs[2]).backward()
    for (key, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu_torch(), q.grad, rtol=1e-5, atol=1e-6, msg=key)
    trace = fileformat.read(path)
    home = min(gtmpi.info()["workers"])
    ops = analysis.select(trace.events[home], (Kind.EXEC,), Lane.WORKER)
    names = [trace.name(int(n)) for n in ops["name"]]
    assert names.count("add_foreach") == 1, names


def _inplace_run(lib, fn):
    """``fn(lib, w, b)``'s sum differentiated: (value, w's gradient), or the error's text."""
    gen = torch.Generator().manual_seed(0)
    w0, b0 = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)
    w = (w0.clone() if lib is torch else gtmpi.tensor(w0)).requires_grad_()
    b = (b0.clone() if lib is torch else gtmpi.tensor(b0)).requires_grad_()
    try:
        out = fn(lib, w, b)
        out.sum().backward()
    except RuntimeError as e:
        return str(e)
    return (out.detach(), w.grad) if lib is torch else (out, w.grad)


def _after(x, *steps):
    for step in steps:
        step(x)
    return x


INPLACE = {
    "relu_": lambda L, w, b: _after(w * b, lambda x: x.relu_()),
    "F.relu(inplace)": lambda L, w, b: L.nn.functional.relu(w @ b.t(), inplace=True),
    "nn.ReLU(inplace)": lambda L, w, b: L.nn.ReLU(inplace=True)(w * b + 1),
    "+= -= *= /=": lambda L, w, b: _after(w * 2, lambda x: x.__iadd__(b),
                                          lambda x: x.__isub__(1), lambda x: x.__imul__(b),
                                          lambda x: x.__itruediv__(3)),
    "mul_ clamp_ sigmoid_": lambda L, w, b: _after(w * b, lambda x: x.mul_(3),
                                                  lambda x: x.clamp_(-0.5, 0.5),
                                                  lambda x: x.sigmoid_()),
    "used before, unsaved": lambda L, w, b: (lambda x: (lambda y: _after(x, lambda x: x.relu_())
                                                        + y)(x + 1))(w * 2),
    "copy_": lambda L, w, b: _after(b * 2, lambda x: x.copy_(w * 3)),  # the gradient: src's
}


@pytest.mark.parametrize("name", INPLACE)
def test_in_place_ops_under_autograd_give_torchs_values_and_gradients(name):
    want, got = _inplace_run(torch, INPLACE[name]), _inplace_run(gtmpi, INPLACE[name])
    assert not isinstance(got, str), got
    assert_same(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert_same(got[1], want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn, message", [
    # a tensor a gradient rule saved, changed in place before backward: torch's error
    (lambda L, w, b: (lambda x: (lambda y: _after(y, lambda _: x.relu_()))(x * b))(w * 2),
     "modified by an inplace operation"),
    (lambda L, w, b: w.relu_(), "a leaf Variable that requires grad"),
    # a view's storage is another tensor's, which a new value would not reach
    (lambda L, w, b: (lambda x: (lambda v: _after(v, lambda _: x.relu_()))(x[0]))(w * 2),
     "on a view, or on a tensor a view was taken of"),
])
def test_in_place_ops_under_autograd_that_cannot_be_right_are_refused(fn, message):
    got = _inplace_run(gtmpi, fn)
    assert isinstance(got, str) and message in got, got
