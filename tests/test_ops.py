"""Every op of the tensor API against torch on random inputs: values, shapes, dtypes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gtmpi
from conftest import assert_same, to_gtmpi

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def rand(gen, *shape, dtype=torch.float32, low=-2.0, high=2.0):
    t = torch.rand(shape, generator=gen, dtype=torch.float64) * (high - low) + low
    return t.to(dtype)


def both(fn, *inputs):
    """fn applied to torch inputs and to the same values as gtmpi tensors; compared."""
    want = fn(*inputs)
    got = fn(*[to_gtmpi(t) if isinstance(t, torch.Tensor) else t for t in inputs])
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert_same(got, want)


BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "truediv": lambda a, b: a / b, "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
    "pow": lambda a, b: abs(a) ** b, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
}
SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((5,), ()), ((), (2, 3))]


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("shapes", SHAPES)
def test_binary_broadcasting(gen, op, shapes):
    a, b = rand(gen, *shapes[0]), rand(gen, *shapes[1], low=0.5)
    both(BINARY[op], a, b)


@pytest.mark.parametrize("op", BINARY)
def test_binary_with_scalars_both_sides(gen, op):
    a = rand(gen, 4, 3, low=0.5)
    fn = BINARY[op]
    both(lambda x: fn(x, 1.5), a)
    both(lambda x: fn(2, x), a)
    both(lambda x: fn(x, 3), a.to(torch.int64) + 1 if op != "truediv" else a)


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.int64])
def test_arithmetic_dtypes_and_promotion(gen, dtype):
    a = rand(gen, 3, 5, low=1, high=9).to(dtype)
    b = rand(gen, 5, low=1, high=9).to(dtype)
    both(lambda x, y: x * y + x - y, a, b)
    both(lambda x: x * 2.5, a)          # int tensor * float -> default float
    both(lambda x, y: x + y, a, b.double())


def test_integer_floordiv_mod_negative(gen):
    a = torch.randint(-20, 20, (4, 6), generator=gen)
    b = torch.randint(1, 7, (6,), generator=gen) * torch.tensor([1, -1, 1, -1, 1, -1])
    both(lambda x, y: (x // y, x % y), a, b)


def test_matmul_shapes(gen):
    both(lambda a, b: a @ b, rand(gen, 3, 4), rand(gen, 4, 5))
    both(lambda a, b: a @ b, rand(gen, 2, 3, 4), rand(gen, 4, 5))
    both(lambda a, b: a @ b, rand(gen, 4), rand(gen, 4, 2))
    both(lambda a, b: gtmpi.matmul(a, b) if isinstance(a, gtmpi.Tensor) else torch.matmul(a, b),
         rand(gen, 2, 1, 3, 4), rand(gen, 5, 4, 2))


def test_logical_ops(gen):
    a, b = rand(gen, 4, 4) > 0, rand(gen, 4, 4) > 0
    both(lambda x, y: (x & y, x | y, x ^ y, ~x), a, b)


UNARY = ["exp", "sqrt", "rsqrt", "log", "sin", "cos", "tanh", "sigmoid", "relu", "abs", "neg"]


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_unary(gen, name, dtype):
    positive = name in ("sqrt", "rsqrt", "log")
    x = rand(gen, 3, 7, low=0.1 if positive else -3, high=3).to(dtype)
    both(lambda t: getattr(t, name)(), x)
    mod = lambda t: gtmpi if isinstance(t, gtmpi.Tensor) else torch  # noqa: E731
    both(lambda t: getattr(mod(t), name)(t), x)


def test_neg_abs_operators(gen):
    both(lambda t: (-t, abs(t), +t), rand(gen, 2, 3))


def test_activations_and_softmax(gen):
    x = rand(gen, 4, 6, low=-4, high=4)
    F = torch.nn.functional
    for g, t in [(gtmpi.gelu, F.gelu), (gtmpi.silu, F.silu), (gtmpi.relu, torch.relu)]:
        assert_same(g(to_gtmpi(x)), t(x))
    assert_same(gtmpi.gelu(to_gtmpi(x), approximate="tanh"), F.gelu(x, approximate="tanh"))
    for dim in (0, 1, -1):
        assert_same(gtmpi.softmax(to_gtmpi(x), dim), torch.softmax(x, dim))
        assert_same(to_gtmpi(x).log_softmax(dim), torch.log_softmax(x, dim))


def test_where_clamp_maximum_minimum(gen):
    x, y = rand(gen, 3, 4), rand(gen, 4)
    c = rand(gen, 3, 4) > 0
    assert_same(gtmpi.where(to_gtmpi(c), to_gtmpi(x), to_gtmpi(y)), torch.where(c, x, y))
    assert_same(gtmpi.where(to_gtmpi(c), to_gtmpi(x), 0.0), torch.where(c, x, 0.0))
    assert_same(to_gtmpi(x).clamp(-0.5, 0.5), x.clamp(-0.5, 0.5))
    assert_same(to_gtmpi(x).clamp(min=0.1), x.clamp(min=0.1))
    assert_same(gtmpi.clamp(to_gtmpi(x), max=to_gtmpi(y)), torch.clamp(x, max=y))
    assert_same(gtmpi.maximum(to_gtmpi(x), to_gtmpi(y)), torch.maximum(x, y))
    assert_same(gtmpi.minimum(to_gtmpi(x), to_gtmpi(y)), torch.minimum(x, y))
    assert_same(to_gtmpi(x).max(to_gtmpi(y)), torch.max(x, y))


DIMS = [None, 0, 1, -1, (0, 2), [1, 2]]


@pytest.mark.parametrize("name", ["sum", "mean", "var", "std", "amax", "amin"])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("keepdim", [False, True])
def test_reductions(gen, name, dim, keepdim):
    x = rand(gen, 3, 4, 5)
    tdim = tuple(dim) if isinstance(dim, list) else dim
    want = getattr(x, name)() if dim is None and not keepdim else getattr(x, name)(dim=tdim, keepdim=keepdim) \
        if dim is not None else getattr(x, name)(dim=tuple(range(3)), keepdim=True)
    g = to_gtmpi(x)
    got = getattr(g, name)() if dim is None and not keepdim else getattr(g, name)(dim=dim, keepdim=keepdim)
    assert_same(got, want)
    # GT's numpy spellings
    got = getattr(g, name)(axis=dim, keepdims=keepdim) if dim is not None else None
    if got is not None:
        assert_same(got, want)


def test_var_std_corrections(gen):
    x = rand(gen, 6, 5)
    g = to_gtmpi(x)
    assert_same(g.var(1, unbiased=False), x.var(1, unbiased=False))
    assert_same(g.std(correction=0), x.std(correction=0))
    assert_same(gtmpi.var(g, 0, ddof=0), x.var(0, correction=0))
    assert_same(gtmpi.std(g, axis=1, keepdims=True), x.std(1, keepdim=True))


def test_max_min_argmax(gen):
    x = rand(gen, 4, 6)
    g = to_gtmpi(x)
    assert_same(g.max(), x.max())
    assert_same(gtmpi.min(g), x.min())
    values, indices = g.max(dim=1)
    assert_same(values, x.max(dim=1).values)
    assert_same(indices, x.max(dim=1).indices)
    r = g.min(0, keepdim=True)
    assert_same(r.values, x.min(0, keepdim=True).values)
    assert_same(r.indices, x.min(0, keepdim=True).indices)
    assert_same(g.max(axis=1), x.amax(1))           # GT spelling: values only
    assert_same(g.max(dim=(0, 1)), x.amax((0, 1)))
    assert_same(g.argmax(), x.argmax())
    assert_same(gtmpi.argmax(g, dim=1, keepdim=True), x.argmax(1, keepdim=True))
    assert_same(g.argmin(axis=0), x.argmin(0))
    assert_same(gtmpi.sum(g, 1), x.sum(1))
    assert_same(gtmpi.mean(g), x.mean())


def test_shape_ops(gen):
    x = rand(gen, 2, 3, 4)
    g = to_gtmpi(x)
    assert_same(g.reshape(6, 4), x.reshape(6, 4))
    assert_same(g.reshape((4, -1)), x.reshape(4, -1))
    assert_same(g.view(-1), x.view(-1))
    assert_same(gtmpi.reshape(g, [3, 8]), x.reshape(3, 8))
    assert_same(g.transpose(0, 2), x.transpose(0, 2))
    assert_same(gtmpi.transpose(g, 1, 2), x.transpose(1, 2))
    assert_same(g.transpose(), x.permute(2, 1, 0))
    assert_same(g[0].T, x[0].T)
    assert_same(g.permute(1, 2, 0), x.permute(1, 2, 0))
    assert_same(gtmpi.permute(g, (2, 0, 1)), x.permute(2, 0, 1))
    y = x.reshape(2, 1, 3, 1, 4)
    gy = to_gtmpi(y)
    assert_same(gy.squeeze(), y.squeeze())
    assert_same(gy.squeeze(1), y.squeeze(1))
    assert_same(gtmpi.squeeze(gy, (1, 3)), y.squeeze((1, 3)))
    assert_same(g.unsqueeze(1), x.unsqueeze(1))
    assert_same(gtmpi.unsqueeze(g, -1), x.unsqueeze(-1))
    assert_same(g.flatten(), x.flatten())
    assert_same(gtmpi.flatten(g, 1), x.flatten(1))
    assert_same(to_gtmpi(x[:, :1]).expand(2, 5, 4), x[:, :1].expand(2, 5, 4))
    assert_same(g.transpose(0, 1).contiguous().view(3, 8), x.transpose(0, 1).contiguous().view(3, 8))


def test_cat_stack_split_chunk(gen):
    a, b = rand(gen, 2, 3), rand(gen, 4, 3)
    assert_same(gtmpi.cat([to_gtmpi(a), to_gtmpi(b)]), torch.cat([a, b]))
    assert_same(gtmpi.cat([to_gtmpi(a), to_gtmpi(a)], dim=1), torch.cat([a, a], 1))
    assert_same(gtmpi.stack([to_gtmpi(a), to_gtmpi(a)], dim=1), torch.stack([a, a], 1))
    for sections in (2, [1, 3]):
        got, want = gtmpi.split(to_gtmpi(b), sections), torch.split(b, sections)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    got, want = to_gtmpi(b).chunk(3, dim=1), b.chunk(3, dim=1)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)


def test_indexing(gen):
    x = rand(gen, 5, 6, 7)
    g = to_gtmpi(x)
    for key in [2, -1, (1, 2), slice(1, 4), (slice(None), slice(None, None, 2)),
                (Ellipsis, 3), (None, 1), (slice(0, 5, 3), None, Ellipsis),
                ([0, 2, 4],), (1, [1, 3], slice(2, 5))]:
        assert_same(g[key], x[key])
    idx = torch.tensor([4, 0, 2])
    assert_same(g[to_gtmpi(idx)], x[idx])
    assert_same(g[:, to_gtmpi(idx)], x[:, idx])
    mask = x[:, :, 0] > 0
    assert_same(g[to_gtmpi(mask)], x[mask])
    assert_same(g[g > 0], x[x > 0])
    assert_same(g[1][to_gtmpi(mask[1])], x[1][mask[1]])


def test_slice_bounds_that_are_tensors(gen):
    """nanoGPT's data line, torch.stack([d[i:i + block] for i in ix]), with ix a tensor: its
    bounds are read on the client (torch reads them too), whichever process the worker is."""
    d = gtmpi.arange(20)
    ix = gtmpi.tensor([3, 0, 11])
    want = torch.stack([torch.arange(20)[i:i + 4] for i in (3, 0, 11)])
    assert_same(gtmpi.stack([d[i:i + 4] for i in ix]), want)
    assert_same(d[gtmpi.tensor(5):torch.tensor(8):gtmpi.tensor(2)], torch.arange(5, 8, 2))
    with pytest.raises(TypeError, match="only integer tensors of a single element"):
        d[gtmpi.tensor(1.5):]


def test_setitem(gen):
    x = rand(gen, 4, 5)
    g = to_gtmpi(x)
    x[1] = 7.0
    g[1] = 7.0
    x[:, 2] = torch.arange(4.0)
    g[:, 2] = gtmpi.arange(4.0)
    x[x < 0] = 0.0
    g[g < 0] = 0.0
    idx = torch.tensor([0, 3])
    x[idx, 1:3] = -1.0
    g[to_gtmpi(idx), 1:3] = -1.0
    x[2:, ::2] = torch.ones(2, 3)
    g[2:, ::2] = np.ones((2, 3), dtype=np.float32)
    assert_same(g, x)


def test_fill_through_a_mask_reads_nothing(gen, monkeypatch):
    """nanoGPT's sampler cuts its logits with ``logits[logits < v[:, [-1]]] = -inf`` every
    token: a fill needs no count of the mask, so it waits for no worker."""
    from gtmpi.client.runtime import Runtime
    reads = []
    read = Runtime.read
    monkeypatch.setattr(Runtime, "read", lambda self, *a: reads.append(a) or read(self, *a))
    x = rand(gen, 3, 5, 2)
    g = to_gtmpi(x)
    v, gv = x[:, :, 0].topk(2)[0], to_gtmpi(x)[:, :, 0].topk(2)[0]
    x[x[:, :, 0] < v[:, [-1]]] = -float("inf")     # a mask of the leading dimensions
    g[g[:, :, 0] < gv[:, [-1]]] = -float("inf")
    x[x > 0.5] = gtmpi.tensor(0.25).cpu_torch()      # a whole-shape mask, a 0-d tensor value
    g[g > 0.5] = gtmpi.tensor(0.25)
    assert not reads
    assert_same(g, x)
    rows = torch.tensor([True, False, True])
    x[rows] = torch.ones(2, 5, 2)                    # values per element: torch counts, so do we
    g[to_gtmpi(rows)] = gtmpi.ones(2, 5, 2)
    assert_same(g, x)
    with pytest.raises(IndexError):
        g[gtmpi.ones(2, 5, dtype=torch.bool)] = 1.0     # the mask must match the leading shape


def test_inplace_and_views(gen):
    x, y = rand(gen, 3, 4), rand(gen, 4)
    g, gy = to_gtmpi(x), to_gtmpi(y)
    same = g
    x += y
    g += gy
    x -= 1
    g -= 1
    x *= 2.0
    g *= 2.0
    x /= y
    g /= gy
    assert same is g
    assert_same(g, x)
    v, gv = x[0], g[0]                 # a view on the worker, as in torch
    v += 100
    gv += 100
    assert_same(g, x)
    g.zero_()
    assert_same(g, torch.zeros(3, 4))
    g.fill_(2.5)
    assert_same(g, torch.full((3, 4), 2.5))
    g.copy_(gy)
    assert_same(g, y.expand(3, 4).clone())
    i = to_gtmpi(torch.arange(4))
    with pytest.raises(RuntimeError, match="in-place|can.t be cast"):
        i += 1.5


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.int64, torch.bool])
def test_dtype_conversions(gen, dtype):
    x = rand(gen, 3, 3, low=-5, high=5)
    g = to_gtmpi(x)
    assert_same(g.to(dtype), x.to(dtype))
    assert_same(to_gtmpi(x.to(dtype)).float(), x.to(dtype).float())


def test_dtype_shorthands(gen):
    x = rand(gen, 2, 2)
    g = to_gtmpi(x)
    assert_same(g.half(), x.half())
    assert_same(g.bfloat16(), x.bfloat16())
    assert_same(g.double(), x.double())
    assert_same(g.long(), x.long())
    assert_same(g.int(), x.int())
    assert_same(g.bool(), x.bool())
    assert_same(g.to("float16"), x.half())
    assert_same(g.to(np.float64), x.double())


def test_creation():
    assert_same(gtmpi.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 2], [3, 4]]))
    assert_same(gtmpi.tensor([1.5, 2.0]), torch.tensor([1.5, 2.0]))
    assert_same(gtmpi.tensor(3.0), torch.tensor(3.0))
    assert_same(gtmpi.tensor([True, False]), torch.tensor([True, False]))
    assert_same(gtmpi.tensor([1, 2], dtype=gtmpi.float16), torch.tensor([1, 2], dtype=torch.float16))
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)
    assert_same(gtmpi.from_numpy(arr), torch.from_numpy(arr))
    assert_same(gtmpi.tensor(arr.T), torch.tensor(arr.T))
    assert_same(gtmpi.zeros(2, 3), torch.zeros(2, 3))
    assert_same(gtmpi.zeros((2, 3), dtype=gtmpi.int32), torch.zeros(2, 3, dtype=torch.int32))
    assert_same(gtmpi.ones([4]), torch.ones(4))
    assert_same(gtmpi.full((2, 2), 7), torch.full((2, 2), 7))
    assert_same(gtmpi.full((2, 2), 0.5, dtype=gtmpi.bfloat16), torch.full((2, 2), 0.5, dtype=torch.bfloat16))
    assert_same(gtmpi.arange(5), torch.arange(5))
    assert_same(gtmpi.arange(1, 4, 0.5), torch.arange(1, 4, 0.5))
    assert_same(gtmpi.arange(10, dtype=gtmpi.float64), torch.arange(10, dtype=torch.float64))
    assert_same(gtmpi.eye(3), torch.eye(3))
    assert_same(gtmpi.eye(2, 4, dtype=gtmpi.int64), torch.eye(2, 4, dtype=torch.int64))
    g = gtmpi.tensor([[1.0, 2.0]])
    assert_same(gtmpi.zeros_like(g), torch.zeros(1, 2))
    assert_same(gtmpi.ones_like(g, dtype=gtmpi.int64), torch.ones(1, 2, dtype=torch.int64))
    assert_same(gtmpi.full_like(g, 3.0), torch.full((1, 2), 3.0))
    assert gtmpi.randn_like(g).shape == (1, 2) and gtmpi.rand_like(g).dtype == torch.float32


def test_upload_is_a_copy():
    arr = np.ones(4, dtype=np.float32)
    g = gtmpi.from_numpy(arr)
    arr[:] = 5
    assert_same(g, torch.ones(4))


def test_random_is_seeded_and_distributed():
    gtmpi.manual_seed(7)
    a = gtmpi.randn(1000)
    b = gtmpi.rand(3, 4, dtype=gtmpi.float64)
    gtmpi.manual_seed(7)
    assert_same(gtmpi.randn(1000), a.cpu_torch())
    assert_same(gtmpi.rand(3, 4, dtype=gtmpi.float64), b.cpu_torch())
    values = a.numpy()
    assert abs(values.mean()) < 0.15 and 0.85 < values.std() < 1.15
    r = b.numpy()
    assert (r >= 0).all() and (r < 1).all()
    assert not np.array_equal(gtmpi.randn(1000).numpy(), values)   # next op, next numbers


def test_reads_and_metadata(gen):
    x = rand(gen, 3, 4)
    g = to_gtmpi(x)
    assert g.shape == (3, 4) and g.ndim == 2 and g.dim() == 2 and len(g) == 3
    assert g.size() == torch.Size([3, 4]) and g.size(1) == 4 and g.numel() == 12
    assert g.dtype == gtmpi.float32 and g.is_floating_point()
    np.testing.assert_array_equal(g.numpy(), x.numpy())
    np.testing.assert_array_equal(g.data.numpy(), x.numpy())
    np.testing.assert_array_equal(np.asarray(g), x.numpy())
    assert g.tolist() == x.tolist()
    assert g[1, 2].item() == x[1, 2].item()
    assert float(g[0, 0]) == float(x[0, 0]) and int(gtmpi.tensor(7)) == 7
    assert bool(gtmpi.tensor(True)) and not bool(gtmpi.tensor(0.0))
    assert [t.tolist() for t in g] == [t.tolist() for t in x]
    assert repr(g) == repr(x)
    assert repr(g.half()) == repr(x.half())
    assert str(gtmpi.arange(3)) == str(torch.arange(3))
    assert repr(gtmpi.tensor(2.5)) == "tensor(2.5000)"


def test_bfloat16_numpy_raises_like_torch():
    with pytest.raises(TypeError, match="BFloat16"):
        gtmpi.ones(2, dtype=gtmpi.bfloat16).numpy()
    assert gtmpi.ones(2, dtype=gtmpi.bfloat16).tolist() == [1.0, 1.0]


def test_operands_from_numpy_and_torch(gen):
    x = rand(gen, 3)
    g = to_gtmpi(x)
    assert_same(g + np.ones(3, dtype=np.float32), x + 1)
    assert_same(g * torch.full((3,), 2.0), x * 2)
    assert_same(g * np.float32(3.0), x * 3.0)
    assert_same(np.ones(3, dtype=np.float32) + g, x + 1)   # numpy defers to gtmpi


# everyday idioms of PyTorch programs (issue 57's newcomer's list): values and gradients
# against torch, the tensor's own values changed where torch changes them in place
IDIOMS = {
    "softmax(dtype=)": lambda t, x, v: t.nn.functional.softmax(x.to(t.bfloat16), dim=-1,
                                                                dtype=t.float32),
    "log_softmax(dtype=)": lambda t, x, v: x.to(t.bfloat16).log_softmax(0, dtype=t.float32),
    "outer": lambda t, x, v: v.outer(v * 2),
    "torch.outer": lambda t, x, v: t.outer(v, v),
    "lerp": lambda t, x, v: t.lerp(x, x * 3, 0.25),
    "repeat_interleave": lambda t, x, v: v.repeat_interleave(3),
    "repeat_interleave(dim)": lambda t, x, v: x.repeat_interleave(2, dim=1),
    "torch.repeat_interleave": lambda t, x, v: t.repeat_interleave(x, 2, dim=0),
    "argsort": lambda t, x, v: x.argsort(dim=-1, descending=True),
    "Embedding.from_pretrained": lambda t, x, v: t.nn.Embedding.from_pretrained(
        x, freeze=False)(t.tensor([2, 0, 2])),
    "sdpa(enable_gqa)": lambda t, x, v: t.nn.functional.scaled_dot_product_attention(
        x.reshape(1, 4, 3, 1).expand(1, 4, 3, 2), x[:2].reshape(1, 2, 2, 2),
        x[1:].reshape(1, 2, 2, 2)[..., :2, :], enable_gqa=True),
}


@pytest.mark.parametrize("idiom", IDIOMS)
def test_everyday_idioms_are_torchs_with_their_gradients(gen, idiom):
    x = rand(gen, 3, 4).requires_grad_()
    v = rand(gen, 4).requires_grad_()
    want = IDIOMS[idiom](torch, x, v)
    gx, gv = to_gtmpi(x.detach()).requires_grad_(), to_gtmpi(v.detach()).requires_grad_()
    got = IDIOMS[idiom](gtmpi, gx, gv)
    assert_same(got, want.detach())
    if not want.dtype.is_floating_point:
        return
    weights = torch.rand(want.shape, generator=gen, dtype=torch.float64).to(want.dtype)
    (want * weights).sum().backward()
    (got * to_gtmpi(weights)).sum().backward()
    for mine, theirs in ((gx, x), (gv, v)):
        if theirs.grad is None:
            assert mine.grad is None
        else:
            assert_same(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)


# in place: the tensor itself changed and returned (outside autograd: an in-place op on a
# tensor that requires grad is refused, ops/table.py)
IN_PLACE = {
    "lerp_": lambda t, x: x.lerp_(x.flip(0), 0.5),
    "relu(inplace)": lambda t, x: t.nn.ReLU(inplace=True)(x),
    "F.relu(inplace)": lambda t, x: t.nn.functional.relu(x, inplace=True),
    "silu(inplace)": lambda t, x: t.nn.SiLU(inplace=True)(x),
    "leaky_relu(inplace)": lambda t, x: t.nn.LeakyReLU(0.1, inplace=True)(x),
    "scatter_add_": lambda t, x: x.scatter_add_(1, t.tensor([[0, 1, 1, 3]] * 3), x * 2),
}


@pytest.mark.parametrize("idiom", IN_PLACE)
def test_everyday_in_place_idioms_change_their_tensor_as_torchs(gen, idiom):
    x = rand(gen, 3, 4)
    gx = to_gtmpi(x)
    want, got = IN_PLACE[idiom](torch, x), IN_PLACE[idiom](gtmpi, gx)
    assert got is gx and want is x
    assert_same(gx, x)


def test_a_frozen_pretrained_embedding_and_bad_idioms_say_what_torch_says():
    table = gtmpi.randn(5, 3)
    frozen = gtmpi.nn.Embedding.from_pretrained(table)
    assert not frozen.weight.requires_grad and frozen.weight.shape == (5, 3)
    with pytest.raises(RuntimeError, match="outer: expected 1-D tensors"):
        table.outer(table)
    with pytest.raises(NotImplementedError, match="an int"):
        table.repeat_interleave(gtmpi.tensor([1, 2, 1, 1, 1]), dim=0)


DATA_SHAPED = {
    "nonzero": lambda t, x: x.nonzero(),
    "torch.nonzero(as_tuple)": lambda t, x: t.nonzero(x, as_tuple=True),
    "x[x.nonzero(as_tuple=True)]": lambda t, x: x[x.nonzero(as_tuple=True)] * 2,
    "unique": lambda t, x: x.unique(),
    "unique(inverse, counts)": lambda t, x: t.unique(x, return_inverse=True, return_counts=True),
    "unique(dim=0)": lambda t, x: x.unique(dim=0),
}


@pytest.mark.parametrize("idiom", DATA_SHAPED)
def test_ops_whose_result_size_is_data_are_torchs(gen, idiom):
    """nonzero and unique: their count is read (as torch's own waits for the GPU), the values
    are torch's, and what uses them runs on the workers."""
    x = (rand(gen, 5, 4) * 2).round().clamp(-1, 1)
    x[3] = x[1]  # a repeated row for unique(dim=0)
    fn = DATA_SHAPED[idiom]
    both(lambda x: fn(gtmpi if isinstance(x, gtmpi.Tensor) else torch, x), x)
