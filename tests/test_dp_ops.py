"""Every op of the table on a batch split over two workers (data parallelism), in strict
placement: each keeps the split where torch's math works row by row, forward and backward,
with torch's numbers; the ops whose math needs the whole batch are exactly those the
architecture notes name (docs/architecture.md, "What data parallelism keeps split")."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import gtmpi
from conftest import assert_same
from gtmpi.client.tensor import apply
from gtmpi.ops.table import OPS, Kind
from gtmpi.placement.rules import PlacementError

WORKERS = sorted(gtmpi.info()["workers"])
pytestmark = pytest.mark.skipif(len(WORKERS) < 2, reason="needs 2 or more workers (the MPI suite)")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"

B = 8  # the batch: every input below but the weights leads with it
_gen = torch.Generator().manual_seed(3)
INPUTS = {
    "x": torch.randn(B, 6, generator=_gen), "y": torch.randn(B, 6, generator=_gen),
    "x3": torch.randn(B, 4, 4, generator=_gen), "c3": torch.randn(B, 3, 10, generator=_gen),
    "c4": torch.randn(B, 3, 6, 6, generator=_gen), "q": torch.randn(B, 2, 4, 3, generator=_gen),
    "k": torch.randn(B, 2, 4, 3, generator=_gen), "v": torch.randn(B, 2, 4, 3, generator=_gen),
    "i": torch.rand(B, 6, generator=_gen).argsort(-1),  # a permutation per row
    "t": torch.randint(0, 6, (B,), generator=_gen),
    # used whole by every member (the config's replicated weights)
    "w": torch.randn(6, 5, generator=_gen), "b": torch.randn(5, generator=_gen),
    "wc1": torch.randn(4, 3, 3, generator=_gen), "wc2": torch.randn(4, 3, 3, 3, generator=_gen),
    "table": torch.randn(6, 5, generator=_gen), "sel": torch.tensor([0, 2]),
}
WHOLE = {"w", "b", "wc1", "wc2", "table", "sel"}
GRAD = {"x", "x3", "c3", "c4", "q", "k", "v", "w", "b", "wc1", "wc2", "table"}


def _masked_scale(L, x, mask, scale):
    """Dropout's mask applied (nn.functional.dropout draws the mask): aten's op on torch."""
    if L is torch:
        return torch.ops.aten.native_dropout_backward(x, mask, scale)
    return apply("masked_scale", x, mask, scale)


def _elementwise_cases() -> dict:
    unary = ["neg", "abs", "exp", "sin", "cos", "tanh", "sigmoid", "relu", "sign", "floor",
             "ceil", "round", "trunc", "erf", "square"]
    cases = {name: (lambda L, F, x, name=name: getattr(x, name)(), "x") for name in unary}
    for name, op in [("add", "__add__"), ("sub", "__sub__"), ("mul", "__mul__"),
                     ("lt", "__lt__"), ("le", "__le__"), ("gt", "__gt__"), ("ge", "__ge__"),
                     ("eq", "__eq__"), ("ne", "__ne__")]:
        cases[name] = (lambda L, F, x, y, op=op: getattr(x, op)(y), "x y")
    for name in ("and", "or", "xor"):
        cases[name] = (lambda L, F, x, y, name=name: getattr((x > 0), f"__{name}__")(y > 0), "x y")
    for name in ("logical_and", "logical_or"):
        cases[name] = (lambda L, F, x, y, name=name: getattr(L, name)(x > 0, y > 0), "x y")
    cases.update({
        "truediv": (lambda L, F, x, y: x / (y.abs() + 1), "x y"),
        "floordiv": (lambda L, F, x, y: x // 0.7, "x y"),
        "mod": (lambda L, F, x, y: x % 0.7, "x y"),
        "pow": (lambda L, F, x, y: x ** 2, "x y"),
        "invert": (lambda L, F, x: ~(x > 0), "x"),
        "log": (lambda L, F, x: (x.abs() + 0.5).log(), "x"),
        "sqrt": (lambda L, F, x: (x.abs() + 0.5).sqrt(), "x"),
        "rsqrt": (lambda L, F, x: (x.abs() + 0.5).rsqrt(), "x"),
        "reciprocal": (lambda L, F, x: (x.abs() + 0.5).reciprocal(), "x"),
        "log1p": (lambda L, F, x: x.abs().log1p(), "x"),
        "expm1": (lambda L, F, x: x.expm1(), "x"),
        **{name: (lambda L, F, x, name=name: getattr(x.tanh() * 0.9, name)(), "x")
           for name in ("tan", "asin", "acos", "atan")},
        **{name: (lambda L, F, x, name=name: getattr(x.abs() + 0.5, name)(), "x")
           for name in ("lgamma", "digamma")},
        "atan2": (lambda L, F, x, y: x.atan2(y), "x y"),
        "hypot": (lambda L, F, x, y: L.hypot(x, y), "x y"),
        "erfinv": (lambda L, F, x: (x.tanh() * 0.9).erfinv(), "x"),
        "gelu": (lambda L, F, x: F.gelu(x), "x"),
        "gelu_grad": (lambda L, F, x: F.gelu(x), "x"),  # gelu's gradient row
        "silu": (lambda L, F, x: F.silu(x), "x"),
        "silu_grad": (lambda L, F, x: F.silu(x), "x"),
        "leaky_relu": (lambda L, F, x: F.leaky_relu(x, 0.1), "x"),
        "where": (lambda L, F, x, y: L.where(y > 0, x, 0.0), "x y"),
        "clamp": (lambda L, F, x: x.clamp(-0.5, 0.5), "x"),
        "maximum": (lambda L, F, x, y: L.maximum(x, y), "x y"),
        "minimum": (lambda L, F, x, y: L.minimum(x, y), "x y"),
        "logical_not": (lambda L, F, x: L.logical_not(x > 0), "x"),
        "isnan": (lambda L, F, x: L.isnan(x), "x"),
        "isinf": (lambda L, F, x: L.isinf(x), "x"),
        "isfinite": (lambda L, F, x: L.isfinite(x), "x"),
        "masked_fill": (lambda L, F, x, y: x.masked_fill(y > 0, 0.0), "x y"),
        "masked_scale": (lambda L, F, x, y: _masked_scale(L, x, y > 0, 2.0), "x y"),
        "to": (lambda L, F, x: x.to(L.float64), "x"),
    })
    return cases


def _set(L, F, x, y):
    z = x.detach() * 1
    z[:, 1] = 0.0
    z[:, 2:4] = y[:, :2]
    return z


def _inplace(method: str, *args):
    def case(L, F, x, y):
        z = x.detach() * 1
        getattr(z, method)(*[y if a == "y" else a for a in args])
        return z
    return case


# op -> (the program, the inputs it takes): every op along the dims an everyday model uses it
CASES = {
    **_elementwise_cases(),
    "sum": (lambda L, F, x: x.sum(), "x"),
    "mean": (lambda L, F, x: x.mean() + x.mean(0).sum() + x.mean(-1).sum(), "x"),
    # along the last dim, by the tensor method of that name (max_dim is x.max(-1))
    **{name: (lambda L, F, x, m=name.removesuffix("_dim"): getattr(x, m)(-1), "x")
       for name in ("amax", "amin", "max_dim", "min_dim", "argmax", "argmin", "var", "std",
                    "softmax", "log_softmax", "cumsum", "cumprod", "prod", "logsumexp")},
    "cummax": (lambda L, F, x: x.cummax(-1), "x"),
    "cummin": (lambda L, F, x: x.cummin(-1), "x"),
    "searchsorted": (lambda L, F, x, y: L.searchsorted(x.sort(-1).values, y), "x y"),
    "vector_norm": (lambda L, F, x: x.norm(dim=-1), "x"),
    "normalize": (lambda L, F, x: F.normalize(x, dim=-1), "x"),
    "any": (lambda L, F, x: (x > 0).any(-1), "x"),
    "all": (lambda L, F, x: (x > -1).all(-1), "x"),
    "topk": (lambda L, F, x: x.topk(2, dim=-1), "x"),
    "sort": (lambda L, F, x: x.sort(-1), "x"),
    "gather": (lambda L, F, x, i: x.gather(-1, i), "x i"),
    "scatter": (lambda L, F, x, y, i: x.scatter(-1, i, y), "x y i"),
    "scatter_add": (lambda L, F, x, y, i: x.scatter_add(-1, i, y), "x y i"),
    "index_select": (lambda L, F, x, sel: x.index_select(-1, sel), "x sel"),
    "tril": (lambda L, F, x3: x3.tril(), "x3"),
    "triu": (lambda L, F, x3: x3.triu(1), "x3"),
    "repeat": (lambda L, F, x: x.repeat(1, 2), "x"),
    "flip": (lambda L, F, x: x.flip(-1), "x"),
    "roll": (lambda L, F, x: x.roll(1, -1), "x"),
    "pad": (lambda L, F, x: F.pad(x, (1, 2)), "x"),
    "one_hot": (lambda L, F, t: F.one_hot(t, 6), "t"),
    "einsum": (lambda L, F, x, y: L.einsum("bi,bi->b", x, y), "x y"),
    "conv1d": (lambda L, F, c3, wc1: F.conv1d(c3, wc1, padding=1), "c3 wc1"),
    "conv2d": (lambda L, F, c4, wc2: F.conv2d(c4, wc2), "c4 wc2"),
    "conv_transpose1d": (lambda L, F, c3, wc1: F.conv_transpose1d(c3, wc1.transpose(0, 1),
                                                                   stride=2), "c3 wc1"),
    "conv_transpose2d": (lambda L, F, c4, wc2: F.conv_transpose2d(c4, wc2.transpose(0, 1),
                                                                   padding=1), "c4 wc2"),
    "max_pool1d": (lambda L, F, c3: F.max_pool1d(c3, 2), "c3"),
    "max_pool2d": (lambda L, F, c4: F.max_pool2d(c4, 2, 1, 1), "c4"),
    "avg_pool1d": (lambda L, F, c3: F.avg_pool1d(c3, 3, padding=1), "c3"),
    "avg_pool2d": (lambda L, F, c4: F.avg_pool2d(c4, 2), "c4"),
    "adaptive_avg_pool1d": (lambda L, F, c3: F.adaptive_avg_pool1d(c3, 2), "c3"),
    "adaptive_avg_pool2d": (lambda L, F, c4: F.adaptive_avg_pool2d(c4, (1, 1)), "c4"),
    "matmul": (lambda L, F, x, w: x @ w, "x w"),
    "linear": (lambda L, F, x, w, b: F.linear(x, w.t(), b), "x w b"),
    "linear_grad": (lambda L, F, x, w, b: F.linear(x, w.t(), b), "x w b"),
    "layer_norm": (lambda L, F, x: F.layer_norm(x, (6,)), "x"),
    "rms_norm": (lambda L, F, x: F.rms_norm(x, (6,)), "x"),
    "scaled_dot_product_attention": (
        lambda L, F, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), "q k v"),
    "embedding": (lambda L, F, i, table: F.embedding(i, table), "i table"),
    "cross_entropy": (lambda L, F, x, t: F.cross_entropy(x, t), "x t"),
    # gtmpi's fused head and loss against torch's two ops
    "linear_cross_entropy": (
        lambda L, F, x, w, t: F.linear_cross_entropy(
            x, w.t(), t % 5, options=gtmpi.nn.LinearCrossEntropyOptions(batch_chunk_size=2))
        if L is gtmpi else F.cross_entropy(F.linear(x, w.t()), t % 5),
        "x w t"),
    "reshape": (lambda L, F, x: x.reshape(B, 2, 3), "x"),
    "view": (lambda L, F, x: x.view(B, 3, 2), "x"),
    "permute": (lambda L, F, x3: x3.permute(0, 2, 1), "x3"),
    "transpose": (lambda L, F, x3: x3.transpose(1, 2), "x3"),
    "squeeze": (lambda L, F, x: x.unsqueeze(1).squeeze(1), "x"),
    "unsqueeze": (lambda L, F, x: x.unsqueeze(-1), "x"),
    "flatten": (lambda L, F, x3: x3.flatten(1), "x3"),
    "expand": (lambda L, F, x: x.unsqueeze(1).expand(B, 2, 6), "x"),
    "contiguous": (lambda L, F, x3: x3.transpose(1, 2).contiguous(), "x3"),
    "clone": (lambda L, F, x: x.clone(), "x"),
    "alias": (lambda L, F, x: x.detach() * 1, "x"),
    "cat": (lambda L, F, x, y: L.cat([x, y], -1), "x y"),
    "stack": (lambda L, F, x, y: L.stack([x, y], -1), "x y"),
    "split": (lambda L, F, x: x.split(4, -1), "x"),
    "chunk": (lambda L, F, x: x.chunk(2, -1), "x"),
    "narrow": (lambda L, F, x: x.narrow(-1, 1, 3), "x"),
    "getitem": (lambda L, F, x3: x3[:, -1] + x3[..., 1:3].sum(-1) + x3[:, None, 0, :].sum(1),
                "x3"),
    "getitem_grad": (lambda L, F, x3: x3[:, -1], "x3"),  # getitem's gradient row
    "setitem": (_set, "x y"),
    "iadd": (_inplace("__iadd__", "y"), "x y"),
    "isub": (_inplace("__isub__", "y"), "x y"),
    "imul": (_inplace("__imul__", "y"), "x y"),
    "itruediv": (_inplace("__itruediv__", 2.0), "x y"),
    "zero_": (_inplace("zero_"), "x y"),
    "fill_": (_inplace("fill_", 1.5), "x y"),
    "copy_": (_inplace("copy_", "y"), "x y"),
    "clamp_": (_inplace("clamp_", -0.5, 0.5), "x y"),
    "masked_fill_": (lambda L, F, x, y: (x.detach() * 1).masked_fill_(y > 0, 0.0), "x y"),
}

# ops no program calls on a batch: made by gtmpi itself (gradients by torch's vjp, pieces,
# optimizer updates over parameters, a sharded checkpoint's files, collectives), or of no
# operand (creation)
INTERNAL = {"vjp", "piece", "pieces", "add_foreach", "norm_foreach", "sgd_foreach",
            "adam_foreach", "zero_foreach", "mul_foreach", "adam_steps", "batch_norm_update_",
            "save_pieces",
            "load_piece_",
            *(n for n, op in OPS.items() if op.kind in (Kind.COMM, Kind.CREATE)),
            *(f"{n}_grad" for n in ("layer_norm", "rms_norm", "scaled_dot_product_attention",
                                    "embedding", "cross_entropy", "linear_cross_entropy"))}
APART = {"multinomial", "normal_", "uniform_", "batch_norm"}  # random, or the batch's statistics


def _whole_batch_ops() -> set[str]:
    """The ops the architecture notes name as needing the whole batch."""
    text = DOCS.read_text()
    part = text[text.index("## What data parallelism keeps split"):]
    part = part[:part.index("\n## ", 4)]
    listed = part[part.index("Need the whole batch"):]
    return set(re.findall(r"`(\w+)`", listed.split("\n\n")[0]))


def _place(names: str, signal_of=lambda n: "weights" if n in WHOLE else "data"):
    out = []
    for n in names.split():
        t = gtmpi.signal.tensor(INPUTS[n].clone(), signal_of(n))
        if n in GRAD:
            t.requires_grad_()
        out.append(t)
    return out


def _host(names: str):
    return [INPUTS[n].clone().requires_grad_(n in GRAD) for n in names.split()]


def _results(r) -> list:
    return list(r) if isinstance(r, (tuple, list)) else [r]


def _backward(results: list, lib) -> bool:
    floats = [r for r in results if r.requires_grad]
    if not floats:
        return False
    sum((r * r).sum() for r in floats).backward()
    return True


@pytest.fixture(scope="module", autouse=True)
def config():
    gtmpi.load_config({"data": {"shard": {"axis": 0, "workers": [0, 1]}},
                       "weights": {"shard": {"workers": [0, 1], "replicated": True}},
                       "one": {"shard": {"workers": [0]}}})


def test_every_op_of_the_table_is_walked():
    assert set(OPS) == set(CASES) | INTERNAL | APART, sorted(set(OPS) ^ (set(CASES) | INTERNAL | APART))


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_op_keeps_a_split_batch_split_with_torchs_numbers(name):
    fn, names = CASES[name]
    operands = _place(names)
    gtmpi.debug.strict_placement()
    try:
        got = _results(fn(gtmpi, gtmpi.nn.functional, *operands))
        graded = _backward(got, gtmpi)
        gtmpi.synchronize()
    finally:
        gtmpi.debug.strict_placement(False)
    host = _host(names)
    want = _results(fn(torch, torch.nn.functional, *host))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w.detach(), rtol=1e-5, atol=1e-5)
    if graded:
        _backward(want, torch)
        for n, g, w in zip(names.split(), operands, host):
            if w.grad is not None:
                assert_same(g.grad, w.grad, rtol=1e-4, atol=1e-5)


# each op the notes name, used along the batch itself: strict placement stops it, and an
# ordinary run gathers and gives torch's numbers
ALONG_THE_BATCH = {
    "amax": lambda x: x.amax(0), "amin": lambda x: x.amin(0),
    "max_dim": lambda x: x.max(0).values, "min_dim": lambda x: x.min(0).values,
    "argmax": lambda x: x.argmax(0), "argmin": lambda x: x.argmin(0),
    "var": lambda x: x.var(0), "std": lambda x: x.std(0),
    "softmax": lambda x: x.softmax(0), "log_softmax": lambda x: x.log_softmax(0),
    "cumsum": lambda x: x.cumsum(0), "prod": lambda x: x.prod(0),
    "cumprod": lambda x: x.cumprod(0), "cummax": lambda x: x.cummax(0).values,
    "cummin": lambda x: x.cummin(0).values,
    "logsumexp": lambda x: x.logsumexp(0), "vector_norm": lambda x: x.norm(dim=0),
    "normalize": lambda x: x / x.norm(dim=0), "any": lambda x: (x > 2).any(0),
    "all": lambda x: (x > -2).all(0), "topk": lambda x: x.topk(2, dim=0).values,
    "sort": lambda x: x.sort(0).values, "flip": lambda x: x.flip(0), "roll": lambda x: x.roll(1, 0),
    "tril": lambda x: x.tril(), "triu": lambda x: x.triu(), "repeat": lambda x: x.repeat(2, 1),
    "batch_norm": lambda x: (gtmpi if isinstance(x, gtmpi.Tensor) else torch).nn.functional.
    batch_norm(x, None, None, training=True),
    "multinomial": lambda x: (gtmpi if isinstance(x, gtmpi.Tensor) else torch).multinomial(
        x.softmax(-1), 2).shape,
}


def test_the_ops_said_to_need_the_whole_batch_are_those_that_gather_it():
    listed = _whole_batch_ops()
    assert listed == set(ALONG_THE_BATCH), listed
    for name, fn in ALONG_THE_BATCH.items():
        (x,) = _place("y")
        gtmpi.debug.strict_placement()
        try:
            with pytest.raises(PlacementError, match="would gather"):
                fn(x)
        finally:
            gtmpi.debug.strict_placement(False)
        got, want = fn(x), fn(INPUTS["y"])
        if isinstance(want, torch.Size):  # draws: their shape (their numbers are one worker's)
            assert got == want
        else:
            assert_same(got, want, rtol=1e-5, atol=1e-5)


def test_random_ops_on_a_split_batch_draw_what_one_worker_draws():
    """Dropout's mask, normal_ and uniform_ in place, multinomial's samples: the numbers of the
    same program on one worker, whatever the split."""
    def program(x):
        gtmpi.manual_seed(5)
        z = x.detach() * 1
        drop = gtmpi.nn.functional.dropout(x, 0.5)
        z.normal_()
        u = (x * 1).uniform_(-1, 1)
        picks = gtmpi.multinomial(x.softmax(-1), 2)
        return [drop, z, u, picks]

    split = [r.cpu_torch() for r in program(*_place("y"))]
    alone = [r.cpu_torch() for r in program(*_place("y", lambda n: "one"))]
    for a, b in zip(split, alone):
        assert torch.equal(a, b)
