"""The torch surface a ported program uses, each idiom against torch on random inputs: ops and
their gradients, torch's grad modes and functions applied to gtmpi tensors, device idioms,
nn layers and Module behaviour (hooks, buffers, tied weights, state dicts), nn.init, and GT's
documented call forms."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gtmpi
import gtmpi.nn as gnn
import gtmpi.nn.functional as GF
from conftest import HOME_DEVICE, assert_same
from test_autograd import grad_check, r

TF = torch.nn.functional
I64 = torch.int64


def idx(*shape, high: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


# ops and gradients: the same expression on torch tensors and on gtmpi tensors ------------------

DIFFERENTIABLE = [
    ("masked_fill", lambda x, m: x.masked_fill(m, -1.5), (r(4, 5), r(4, 5) > 0)),
    ("masked_fill with a row mask", lambda x, m: x.masked_fill(m[:1], 0.0), (r(4, 5), r(4, 5) > 0)),
    ("tril", lambda x: x.tril(), (r(5, 5),)),
    ("triu with diagonal", lambda x: x.triu(1), (r(3, 4, 4),)),
    ("square", lambda x: x.square(), (r(3, 4),)),
    ("erf", lambda x: x.erf(), (r(3, 4),)),
    ("log1p", lambda x: x.log1p(), (r(3, 4, low=0.1),)),
    ("reciprocal", lambda x: x.reciprocal(), (r(3, 4, low=0.5),)),
    ("floor, round and sign have zero gradients", lambda x: x.floor() + x.round() + x.sign() + x,
     (r(3, 4),)),
    ("leaky_relu", lambda x: TF.leaky_relu(x, 0.2) if isinstance(x, torch.Tensor) else
     GF.leaky_relu(x, 0.2), (r(3, 4),)),
    ("cumsum", lambda x: x.cumsum(1), (r(3, 4),)),
    ("prod over a dim", lambda x: x.prod(1), (r(3, 4, low=0.5),)),
    ("prod of all", lambda x: x.prod(), (r(2, 3, low=0.5),)),
    ("logsumexp", lambda x: x.logsumexp(-1, keepdim=True), (r(3, 4),)),
    ("norm", lambda x: x.norm(), (r(3, 4),)),
    ("norm over a dim", lambda x: x.norm(dim=1), (r(3, 4),)),
    ("norm p=1", lambda x: x.norm(p=1, dim=0), (r(3, 4),)),
    ("topk values", lambda x: x.topk(2, dim=1).values, (r(3, 6),)),
    ("sort values", lambda x: x.sort(dim=-1, descending=True).values, (r(3, 6),)),
    ("gather", lambda x: x.gather(1, idx(3, 2, high=5)), (r(3, 5),)),
    ("index_select", lambda x: x.index_select(0, idx(4, high=3)), (r(3, 5),)),
    ("repeat", lambda x: x.repeat(2, 1, 3), (r(3, 2),)),
    ("flip", lambda x: x.flip(0, 1), (r(3, 2),)),
    ("roll", lambda x: x.roll(1, 0), (r(3, 2),)),
    ("unbind", lambda x: x.unbind(1), (r(3, 2),)),
    ("t and mT", lambda x: x.t() + x.mT, (r(3, 3),)),
    # distinct positions per row: where two sources meet, which one lands is undefined on GPUs
    ("scatter", lambda x, s: x.scatter(1, torch.tensor([[0, 2], [3, 1], [1, 0]]), s),
     (r(3, 4), r(3, 2))),
    ("scatter of a value", lambda x: x.scatter(0, idx(2, 4, high=3), 2.5), (r(3, 4),)),
    ("scatter_add", lambda x, s: x.scatter_add(1, idx(3, 2, high=4), s), (r(3, 4), r(3, 2))),
    ("addmm", lambda c, a, b: (torch if isinstance(a, torch.Tensor) else gtmpi).addmm(
        c, a, b, beta=0.5, alpha=2.0), (r(2, 5), r(2, 3), r(3, 5))),
    ("baddbmm", lambda c, a, b: (torch if isinstance(a, torch.Tensor) else gtmpi).baddbmm(
        c, a, b), (r(2, 3, 5), r(2, 3, 4), r(2, 4, 5))),
    ("bmm", lambda a, b: torch.bmm(a, b) if isinstance(a, torch.Tensor) else gtmpi.bmm(a, b),
     (r(2, 3, 4), r(2, 4, 5))),
    ("einsum", lambda a, b: (torch if isinstance(a, torch.Tensor) else gtmpi).einsum(
        "bij,bkj->bik", a, b), (r(2, 3, 4), r(2, 5, 4))),
    ("pad", lambda x: (TF if isinstance(x, torch.Tensor) else GF).pad(x, (1, 2), value=0.5),
     (r(2, 3),)),
    ("normalize", lambda x: (TF if isinstance(x, torch.Tensor) else GF).normalize(x, dim=-1),
     (r(3, 4),)),
    ("view_as", lambda x, y: x.view_as(y) * 2, (r(2, 6), r(3, 4) > 0)),
]


def _lib(x):
    return torch if isinstance(x, torch.Tensor) else gtmpi


DIFFERENTIABLE += [
    ("clamp_min and clamp_max", lambda x: x.clamp_min(-0.5) + _lib(x).clamp_max(x, 0.5),
     (r(3, 4),)),
    ("movedim", lambda x: x.movedim((0, 1), (2, 0)) * 2, (r(2, 3, 4),)),
    ("moveaxis and swapaxes", lambda x: _lib(x).moveaxis(x, -1, 0).swapaxes(1, 2), (r(2, 3, 4),)),
    ("masked_select", lambda x, m: x.masked_select(m[0]), (r(3, 4), r(3, 4) > 0)),
    ("addcmul and addcdiv", lambda x, a, b: _lib(x).addcmul(x, a, b, value=0.5).addcdiv(
        a, b.abs() + 1, value=2), (r(3, 4), r(3, 4), r(3, 4))),
    ("cdist", lambda a, b: _lib(a).cdist(a, b) + _lib(a).cdist(a, b, p=1.0) +
     _lib(a).cdist(a, b, p=3.0), (r(2, 5, 3), r(2, 4, 3))),
    ("diag", lambda v, m: _lib(v).diag(v).sum(0) + _lib(m).diag(m), (r(3), r(3, 5))),
    ("meshgrid", lambda a, b: sum(g * (i + 1) for i, g in enumerate(
        _lib(a).meshgrid(a, b, indexing="xy"))), (r(3), r(4))),
]


def test_parameter_lists_and_dicts_are_torchs():
    """Registered by position and by name: torch's state-dict keys, every parameter given to
    the optimizer and updated; a tensor given becomes a Parameter."""
    got = {}
    for lib in (torch, gtmpi):
        nn_ = torch.nn if lib is torch else gnn

        class Model(nn_.Module):
            def __init__(self):
                super().__init__()
                self.scales = nn_.ParameterList([nn_.Parameter(lib.ones(3)), lib.zeros(3)])
                self.scales.append(nn_.Parameter(lib.full((3,), 2.0)))
                self.named = nn_.ParameterDict({"a": nn_.Parameter(lib.ones(2))})
                self.named["b"] = nn_.Parameter(lib.zeros(2))

            def forward(self, x):
                return sum(s * x for s in self.scales).sum() + self.named["a"].sum() * \
                    self.named["b"].sum()
        model = Model()
        opt = lib.optim.SGD(model.parameters(), lr=0.5)
        model(lib.ones(3)).backward()
        opt.step()
        assert len(model.scales) == 3 and list(model.named) == ["a", "b"] and "a" in model.named
        assert all(isinstance(p, nn_.Parameter) for p in model.scales)
        got[lib] = {k: (v.tolist()) for k, v in model.state_dict().items()}
    assert got[gtmpi] == got[torch]


def _nn(x):
    return torch.nn if isinstance(x, torch.Tensor) else gnn


def _probs(*shape):
    return r(*shape, low=0.05, high=0.95)


DIFFERENTIABLE += [
    (f"nn.{name}{kw or ''}", lambda a, b, name=name, kw=kw: getattr(_nn(a), name)(**kw)(a, b),
     inputs) for name, kw, inputs in [
        ("L1Loss", {}, (r(3, 4), r(3, 4))),
        ("L1Loss", {"reduction": "sum"}, (r(3, 4), r(3, 4))),
        ("SmoothL1Loss", {"beta": 0.5}, (r(3, 4), r(3, 4))),
        ("SmoothL1Loss", {"beta": 0.0}, (r(3, 4), r(3, 4))),
        ("HuberLoss", {"delta": 0.7, "reduction": "none"}, (r(3, 4), r(3, 4))),
        ("KLDivLoss", {"reduction": "batchmean"}, (r(3, 4, low=-3.0, high=-0.1), _probs(3, 4))),
        ("KLDivLoss", {"log_target": True}, (r(3, 4, low=-3.0, high=-0.1),
                                             r(3, 4, low=-3.0, high=-0.1))),
        ("BCELoss", {}, (_probs(3, 4), _probs(3, 4))),
        ("BCEWithLogitsLoss", {"reduction": "sum"}, (r(3, 4), _probs(3, 4))),
        ("CosineSimilarity", {"dim": -1}, (r(3, 4), r(3, 4))),
        ("PairwiseDistance", {"p": 3.0, "keepdim": True}, (r(3, 4), r(3, 4)))]]
DIFFERENTIABLE += [
    ("GroupNorm", lambda x: _nn(x).GroupNorm(2, 4).to(x.dtype)(x), (r(3, 4, 5, 2),)),
    ("GroupNorm without affine", lambda x: _nn(x).GroupNorm(4, 4, affine=False)(x),
     (r(2, 4, 6),)),
    ("InstanceNorm2d", lambda x: _nn(x).InstanceNorm2d(3, affine=True).to(x.dtype)(x),
     (r(2, 3, 4, 5),)),
    ("InstanceNorm1d unbatched", lambda x: _nn(x).InstanceNorm1d(3)(x), (r(3, 6),)),
]


DIFFERENTIABLE += [
    ("tile and broadcast_to", lambda x: _lib(x).tile(x, (2, 1, 2)).sum(0) +
     x[0].broadcast_to((3, 4)).tile((1, 2)), (r(2, 3, 4),)),
    ("log2, log10, exp2, sinh, cosh, frac", lambda x: x.abs().log2() + _lib(x).log10(x.abs()) +
     x.exp2() + x.sinh() + _lib(x).cosh(x) + x.frac(), (r(3, 4, low=0.2),)),
    ("logaddexp, logit, xlogy", lambda a, b: a.logaddexp(b) + _lib(b).logit(b.sigmoid(), 0.1) +
     a.xlogy(b.abs()), (r(3, 4), r(3, 4))),
    ("fmod and remainder", lambda x: x.fmod(0.7) + _lib(x).remainder(x, 0.9), (r(3, 4),)),
    ("nan_to_num of finite numbers", lambda x: x.nan_to_num(), (r(3, 4),)),
    ("diff", lambda x: x.diff() + _lib(x).diff(x, 2, 1, prepend=x[:, :2])[:, :4], (r(3, 5),)),
    ("dot and inner", lambda a, b: a[0].dot(b[0]) + _lib(a).inner(a, b).sum(), (r(3, 4), r(3, 4))),
    ("take_along_dim", lambda x: x.take_along_dim(idx(3, 2, high=4), 1) +
     _lib(x).take_along_dim(x, idx(3, 1, high=4, seed=5), 1), (r(3, 4),)),
    ("diagonal and trace", lambda x: x.diagonal(1, 1, 2).sum() + x.diagonal(-1).sum() +
     x[0].trace(), (r(3, 4, 5),)),
    ("var_mean and std_mean", lambda x: sum(_lib(x).var_mean(x, 1)) + sum(_lib(x).std_mean(x)),
     (r(3, 4),)),
    ("kthvalue and median", lambda x: x.kthvalue(2, 1).values + x.median(1).values +
     x.median(), (r(3, 5),)),
    ("hstack, vstack, column_stack", lambda a, b: _lib(a).hstack([a, b]).sum(0) +
     _lib(a).vstack([a[0], b[0]]).sum(1).sum() + _lib(a).column_stack([a[0], b[0]]).sum(),
     (r(3, 4), r(3, 4))),
]


def test_predicates_counts_and_in_place_forms_of_the_newcomers_list_are_torchs():
    x = r(3, 4)
    x[0, 0], x[0, 1], x[1, 1] = 0.0, -0.0, 0.0
    g = gtmpi.tensor(x)
    for name, args in (("signbit", ()), ("count_nonzero", ()), ("count_nonzero", (1,)),
                       ("floor_divide", (0.7,)),
                       ("heaviside", (torch.tensor([0.5], dtype=x.dtype),))):
        got = getattr(g, name)(*[gtmpi.tensor(a) if isinstance(a, torch.Tensor) else a
                                 for a in args])
        assert torch.equal(got.cpu_torch(), getattr(x, name)(*args)), name
    for got, want in zip(gtmpi.aminmax(g, dim=1), x.aminmax(dim=1), strict=True):
        assert torch.equal(got.cpu_torch(), want)
    w = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    assert torch.equal(gtmpi.nan_to_num(gtmpi.tensor(w)).cpu_torch(), w.nan_to_num())
    assert torch.equal(gtmpi.tensor(w).nan_to_num(1.0, 5.0).cpu_torch(), w.nan_to_num(1.0, 5.0))
    for got, want in zip(gtmpi.broadcast_tensors(g[0], g[:, :1]),
                         torch.broadcast_tensors(x[0], x[:, :1]), strict=True):
        assert torch.equal(got.cpu_torch(), want)
    t = gtmpi.tensor(x)
    t.addcmul_(g, g, value=0.5).addcdiv_(g, g.abs() + 1).square_().clip_(0.0, 1.0)
    assert_same(t, (x + 0.5 * x * x + x / (x.abs() + 1)).square().clip(0.0, 1.0))
    drawn = gtmpi.bernoulli(gtmpi.full((4000,), 0.3)).cpu_torch()
    assert set(drawn.tolist()) == {0.0, 1.0} and abs(drawn.mean().item() - 0.3) < 0.04


def test_kl_div_counts_nothing_where_the_target_is_zero():
    """torch's xlogy: a zero target adds 0 (not 0 * log 0), and the input's gradient there is
    0 (the target's own gradient at 0 is torch's -inf times the mask: not compared)."""
    logp, q = r(3, 4, low=-3.0, high=-0.1), _probs(3, 4)
    q = q * (q > 0.5)
    t_in = logp.clone().requires_grad_()
    want = TF.kl_div(t_in, q, reduction="sum")
    want.backward()
    g_in = gtmpi.tensor(logp, requires_grad=True)
    got = GF.kl_div(g_in, gtmpi.tensor(q), reduction="sum")
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.equal(g_in.grad.cpu_torch(), t_in.grad)


def test_closeness_and_exclusive_or_are_torchs():
    a, b = r(3, 4), r(3, 4)
    a[0, 0], a[0, 1], a[0, 2] = float("inf"), float("nan"), 1.0
    b = a.clone()
    b[1] += 1e-6
    b[0, 2] = 1.0 + 1e-9
    ga, gb = gtmpi.tensor(a), gtmpi.tensor(b)
    for kw in ({}, {"equal_nan": True}, {"rtol": 0.0, "atol": 1e-7}):
        assert torch.equal(gtmpi.isclose(ga, gb, **kw).cpu_torch(), torch.isclose(a, b, **kw))
    assert torch.equal(ga.isclose(1.0).cpu_torch(), a.isclose(torch.full_like(a, 1.0)))
    assert torch.equal(gtmpi.logical_xor(ga > 0, gb > 0.5).cpu_torch(),
                       torch.logical_xor(a > 0, b > 0.5))


# torch's activation modules, each made with these arguments in both libraries
ACTIVATIONS = [("Hardtanh", (-0.5, 1.5), {}), ("ReLU6", (), {}), ("ELU", (0.7,), {}),
               ("CELU", (0.7,), {}), ("SELU", (), {}), ("Softplus", (2.0, 3.0), {}),
               ("Mish", (), {}), ("Hardsigmoid", (), {}), ("Hardswish", (), {}),
               ("Softsign", (), {}), ("Tanhshrink", (), {}), ("LogSigmoid", (), {}),
               ("GLU", (), {"dim": 1}), ("Threshold", (0.3, -1.0), {}),
               ("Softmin", (), {"dim": 1}), ("LogSoftmax", (1,), {}), ("Softmin", (), {}),
               ("PReLU", (), {}), ("PReLU", (4, 0.1), {})]
DIFFERENTIABLE += [
    (f"nn.{name}{args or ''}{kw or ''}",
     lambda x, name=name, args=args, kw=kw: getattr(
         torch.nn if isinstance(x, torch.Tensor) else gnn, name)(*args, **kw).to(x.dtype)(x),
     (r(3, 4, low=-4.0, high=4.0),)) for name, args, kw in ACTIVATIONS]


DIFFERENTIABLE += [
    ("cumprod", lambda x: x.cumprod(1) + _lib(x).cumprod(x, 0), (r(3, 4, low=0.5),)),
    ("cummax and cummin values", lambda x: x.cummax(1).values + _lib(x).cummin(x, 0).values,
     (r(3, 4),)),
]


def test_searchsorted_and_bucketize_are_torchs():
    rows = torch.sort(r(3, 6), -1).values
    edges = torch.tensor([-1.0, 0.0, 0.5], dtype=rows.dtype)
    x = r(3, 4)
    x[0, 0] = 0.5  # on an edge: right decides
    for kw in ({}, {"right": True}, {"out_int32": True}, {"side": "right"}):
        assert torch.equal(gtmpi.searchsorted(gtmpi.tensor(rows), gtmpi.tensor(x[:, :2]),
                                              **kw).cpu_torch(),
                           torch.searchsorted(rows, x[:, :2], **kw))
    for kw in ({}, {"right": True}):
        assert torch.equal(gtmpi.bucketize(gtmpi.tensor(x), gtmpi.tensor(edges), **kw).cpu_torch(),
                           torch.bucketize(x, edges, **kw))
    got, want = gtmpi.tensor(x).cummax(1), x.cummax(1)
    assert torch.equal(got.indices.cpu_torch(), want.indices)


DIFFERENTIABLE += [
    ("tan, asin, acos, atan and their arc names", lambda x: x.tan() + x.asin() + x.acos() +
     _lib(x).atan(x) + _lib(x).arcsin(x), (r(3, 4, low=-0.9, high=0.9),)),
    ("lgamma and digamma", lambda x: x.lgamma() + _lib(x).digamma(x), (r(3, 4, low=0.3),)),
    ("atan2 and hypot", lambda a, b: a.atan2(b) + _lib(a).hypot(a, b) + _lib(a).arctan2(b, a),
     (r(3, 4), r(3, 4))),
]


RESAMPLED = [
    ("nearest", {"scale_factor": 2}, (2, 3, 4, 5)), ("nearest", {"size": (7, 3)}, (2, 3, 4, 5)),
    ("nearest", {"scale_factor": 1.5}, (2, 3, 5)), ("linear", {"size": 9}, (2, 3, 5)),
    ("linear", {"scale_factor": 2, "align_corners": True}, (2, 3, 5)),
    ("bilinear", {"scale_factor": 2}, (2, 3, 4, 5)),
    ("bilinear", {"size": (3, 8), "align_corners": True}, (2, 3, 4, 5)),
    ("bilinear", {"scale_factor": 0.5}, (1, 2, 6, 6))]
DIFFERENTIABLE += [
    (f"interpolate {mode} {kw}", lambda x, mode=mode, kw=kw: (
        TF if isinstance(x, torch.Tensor) else GF).interpolate(x, mode=mode, **kw), (r(*shape),))
    for mode, kw, shape in RESAMPLED] + [
    ("nn.Upsample", lambda x: _nn(x).Upsample(scale_factor=2, mode="bilinear")(x),
     (r(1, 2, 3, 3),)),
    ("pixel_shuffle and unshuffle", lambda x: _nn(x).PixelShuffle(2)(x) +
     _nn(x).PixelUnshuffle(2)(_nn(x).PixelShuffle(2)(x)).sum() * 0.1, (r(2, 8, 3, 4),)),
    ("padding modules", lambda x: _nn(x).ZeroPad2d((1, 0, 2, 1))(x).sum() +
     _nn(x).ConstantPad2d(1, 0.5)(x).sum() + _nn(x).ReflectionPad2d(1)(x) .sum() +
     _nn(x).ReplicationPad1d((2, 1))(x[0]).sum(), (r(2, 3, 4, 4),)),
]


@pytest.mark.parametrize("name,fn,inputs", DIFFERENTIABLE, ids=[d[0] for d in DIFFERENTIABLE])
def test_op_and_its_gradient_match_torch(name, fn, inputs):
    grad_check(fn, *inputs)


def test_activations_in_place_and_their_refusals_are_torchs():
    x = r(3, 4, low=-4.0, high=4.0)
    for name, args in (("elu", (0.5,)), ("hardtanh", (-1.0, 2.0)), ("relu6", ()),
                       ("selu", ()), ("hardswish", ()), ("threshold", (0.1, 2.0))):
        g = gtmpi.tensor(x)
        out = getattr(GF, name)(g, *args, inplace=True)
        assert out is g
        assert_same(g, getattr(TF, name)(x.clone(), *args))
    with pytest.raises(RuntimeError, match="Halving dimension must be even"):
        GF.glu(gtmpi.ones(2, 3))
    with pytest.raises(TypeError, match="missing required argument: 'value'"):
        gnn.Threshold(0.1)
    assert repr(gnn.Hardtanh(-2.0, 2.0)) == repr(torch.nn.Hardtanh(-2.0, 2.0))
    assert gnn.Unflatten(1, (2, 3))(gtmpi.ones(4, 6, 5)).shape == (4, 2, 3, 5)
    assert gnn.Unflatten(-1, (2, 2))(gtmpi.ones(3, 4)).shape == (3, 2, 2)


def test_reductions_and_predicates_without_gradients():
    x = r(4, 6)
    g = gtmpi.tensor(x)
    assert_same((g > 0).any(), (x > 0).any())
    assert_same((g > -3).all(), (x > -3).all())
    assert_same((g > 0).any(1, keepdim=True), (x > 0).any(1, keepdim=True))
    assert_same(g.topk(3).indices, x.topk(3).indices)
    assert_same(g.sort(0).indices, x.sort(0).indices)
    assert_same((g > 0).logical_not(), (x > 0).logical_not())
    assert_same(gtmpi.isfinite(g / 0.0), torch.isfinite(x / 0.0))
    assert_same(GF.one_hot(gtmpi.tensor(idx(5, high=4)), 4), TF.one_hot(idx(5, high=4), 4))
    assert_same(GF.one_hot(gtmpi.tensor(idx(5, high=4))), TF.one_hot(idx(5, high=4)))
    assert gtmpi.allclose(g, gtmpi.tensor(x + 1e-12)) and not gtmpi.allclose(g, g + 1)
    assert gtmpi.equal(g, gtmpi.tensor(x))
    assert f"{g.sum():.3f}" == f"{x.sum():.3f}"
    assert_same(g.type_as(gtmpi.zeros(1, dtype=torch.int32)), x.type_as(torch.zeros(1, dtype=torch.int32)))


def test_in_place_forms_match_torch():
    x = r(3, 4)
    g = gtmpi.tensor(x)
    t = x.clone()
    g.add_(1.5).mul_(2).sub_(gtmpi.tensor(x), alpha=0.5).div_(3).clamp_(-1, 1)
    t.add_(1.5).mul_(2).sub_(x, alpha=0.5).div_(3).clamp_(-1, 1)
    assert_same(g, t)
    g.masked_fill_(gtmpi.tensor(x) > 0, 7.0)
    t.masked_fill_(x > 0, 7.0)
    assert_same(g, t)


# schedules torch programs use every day, each against torch's for 16 steps and resumed
EVERYDAY_SCHEDULES = {
    "MultiStepLR": lambda o, lib: lib.optim.lr_scheduler.MultiStepLR(o, [2, 5, 5, 9], 0.5),
    "ConstantLR": lambda o, lib: lib.optim.lr_scheduler.ConstantLR(o, 0.25, total_iters=4),
    "PolynomialLR": lambda o, lib: lib.optim.lr_scheduler.PolynomialLR(o, 10, power=2.0),
    "MultiplicativeLR": lambda o, lib: lib.optim.lr_scheduler.MultiplicativeLR(
        o, lambda e: 0.95 if e % 2 else 0.9),
    "CosineAnnealingWarmRestarts": lambda o, lib:
        lib.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, 3, T_mult=2, eta_min=1e-3),
    "SequentialLR": lambda o, lib: lib.optim.lr_scheduler.SequentialLR(
        o, [lib.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, total_iters=3),
            lib.optim.lr_scheduler.CosineAnnealingLR(o, 8, eta_min=1e-3),
            lib.optim.lr_scheduler.MultiplicativeLR(o, lambda e: 0.9)], milestones=[3, 9]),
}


def test_in_place_unary_forms_and_schedulers_match_torch():
    x = r(3, 4, low=0.5)
    g = gtmpi.tensor(x)
    t = x.clone()
    g.exp_().log_().sqrt_().neg_().abs_().tanh_().sigmoid_().pow_(2).relu_()
    t.exp_().log_().sqrt_().neg_().abs_().tanh_().sigmoid_().pow_(2).relu_()
    assert_same(g, t)
    for make in (lambda o, lib: lib.optim.lr_scheduler.StepLR(o, 3, gamma=0.5),
                 lambda o, lib: lib.optim.lr_scheduler.ExponentialLR(o, 0.9),
                 lambda o, lib: lib.optim.lr_scheduler.LinearLR(o, 0.25, 1.0, total_iters=4),
                 lambda o, lib: lib.optim.lr_scheduler.CosineAnnealingLR(o, 10, eta_min=1e-4),
                 *EVERYDAY_SCHEDULES.values()):
        topt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        gopt = gtmpi.optim.SGD([gnn.Parameter(gtmpi.zeros(2))], lr=0.1)
        ts, gs = make(topt, torch), make(gopt, gtmpi)
        for _ in range(16):
            assert gs.get_last_lr() == pytest.approx(ts.get_last_lr(), rel=1e-9, abs=1e-12)
            topt.step()
            ts.step()
            gs.step()


def test_sequential_lr_refuses_what_torchs_refuses():
    opt = gtmpi.optim.SGD([gnn.Parameter(gtmpi.zeros(2))], lr=0.1)
    other = gtmpi.optim.SGD([gnn.Parameter(gtmpi.zeros(2))], lr=0.1)
    sched = gtmpi.optim.lr_scheduler
    with pytest.raises(ValueError, match="number of milestone points"):
        sched.SequentialLR(opt, [sched.ConstantLR(opt), sched.ExponentialLR(opt, 0.9)], [2, 4])
    with pytest.raises(ValueError, match="belong to the same optimizer"):
        sched.SequentialLR(opt, [sched.ConstantLR(opt), sched.ExponentialLR(other, 0.9)], [2])
    with pytest.raises(ValueError, match="does not support `ReduceLROnPlateau`"):
        sched.SequentialLR(opt, [sched.ConstantLR(opt), sched.ReduceLROnPlateau(opt)], [2])


@pytest.mark.parametrize("kw", [{}, {"anneal_strategy": "linear"}, {"three_phase": True},
                                {"cycle_momentum": False}])
@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
def test_one_cycle_lr_matches_torch(kw, opt):
    extra = {"momentum": 0.9} if opt == "SGD" else {}
    topt = getattr(torch.optim, opt)([torch.nn.Parameter(torch.zeros(2))], lr=0.1, **extra)
    gopt = getattr(gtmpi.optim, opt)([gnn.Parameter(gtmpi.zeros(2))], lr=0.1, **extra)
    ts = torch.optim.lr_scheduler.OneCycleLR(topt, max_lr=0.5, total_steps=20, **kw)
    gs = gtmpi.optim.lr_scheduler.OneCycleLR(gopt, max_lr=0.5, total_steps=20, **kw)
    key = "betas" if opt == "AdamW" else "momentum"
    for _ in range(20):
        assert gs.get_last_lr() == pytest.approx(ts.get_last_lr(), rel=1e-9, abs=1e-12)
        assert gopt.param_groups[0][key] == pytest.approx(topt.param_groups[0][key], rel=1e-9)
        topt.step()
        ts.step()
        gs.step()
    with pytest.raises(ValueError, match="Tried to step 21 times"):
        gs.step()


def test_reduce_lr_on_plateau_matches_torch():
    metrics = [5, 4, 4, 4, 4, 3.9999, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2]
    for kw in ({"patience": 2}, {"patience": 1, "cooldown": 2, "factor": 0.5},
               {"mode": "max", "patience": 0, "threshold_mode": "abs", "min_lr": 0.02}):
        topt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        gopt = gtmpi.optim.SGD([gnn.Parameter(gtmpi.zeros(2))], lr=0.1)
        ts = torch.optim.lr_scheduler.ReduceLROnPlateau(topt, **kw)
        gs = gtmpi.optim.lr_scheduler.ReduceLROnPlateau(gopt, **kw)
        for m in metrics:
            ts.step(m)
            gs.step(gtmpi.tensor(float(m)))  # a loss tensor, as a training loop passes it
            assert gs.get_last_lr() == pytest.approx(ts.get_last_lr(), rel=1e-12)


def test_randperm_is_a_seeded_permutation():
    gtmpi.manual_seed(5)
    a = gtmpi.randperm(50)
    gtmpi.manual_seed(5)
    b = gtmpi.randperm(50, dtype=gtmpi.int32)
    assert a.dtype == I64 and b.dtype == torch.int32 and a.shape == (50,)
    assert sorted(a.tolist()) == list(range(50)) and a.tolist() == b.tolist()
    assert a.tolist() != list(range(50))


def test_clip_grad_norm_without_gradients_is_zero_as_in_torch():
    p = gnn.Parameter(gtmpi.ones(2))
    got = gtmpi.nn.utils.clip_grad_norm_([p], 1.0)
    want = torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0)
    assert got.item() == want.item() == 0.0


def test_random_ops_are_seeded_and_distributed_as_asked():
    gtmpi.manual_seed(3)
    a = gtmpi.randint(0, 10, (1000,))
    gtmpi.manual_seed(3)
    b = gtmpi.randint(10, (1000,))
    assert a.dtype == I64 and a.shape == (1000,)
    assert torch.equal(a.cpu_torch(), b.cpu_torch())
    assert 0 <= int(a.min()) and int(a.max()) <= 9 and len(set(a.tolist())) == 10
    probs = gtmpi.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    draws = gtmpi.multinomial(probs, 4, replacement=True).cpu_torch()
    assert draws.shape == (2, 4) and draws.dtype == I64
    assert (draws[0] == 1).all() and set(draws[1].tolist()) <= {0, 2}
    w = gtmpi.zeros(200, 300)
    w.normal_(0.0, 0.02)
    v = w.cpu_torch()
    assert abs(float(v.mean())) < 1e-3 and abs(float(v.std()) - 0.02) < 1e-3
    w.uniform_(-0.5, 0.5)
    v = w.cpu_torch()
    assert -0.5 <= float(v.min()) and float(v.max()) <= 0.5 and float(v.std()) > 0.25


# torch's grad modes and functions on gtmpi tensors ------------------------------------------

def test_torch_no_grad_records_nothing_and_allows_in_place_updates():
    w = gtmpi.tensor(r(3, 3), requires_grad=True)
    (w * w).sum().backward()
    with torch.no_grad():
        y = w * 2
        w -= 0.1 * w.grad  # torch's manual SGD step
    assert not y.requires_grad and y.grad_fn is None
    assert w.is_leaf and w.requires_grad

    @torch.no_grad()
    def evaluate(t):
        return t * 3

    assert not evaluate(w).requires_grad
    with torch.inference_mode():
        assert not (w + 1).requires_grad
    with torch.enable_grad():
        assert (w + 1).requires_grad
    gtmpi.set_grad_enabled(False)
    assert not (w + 1).requires_grad
    gtmpi.set_grad_enabled(True)
    with gtmpi.set_grad_enabled(False):
        assert not (w + 1).requires_grad
    assert (w + 1).requires_grad


def test_torch_functions_on_gtmpi_tensors_run_gtmpi_ops():
    x = r(3, 4)
    g = gtmpi.tensor(x, requires_grad=True)
    out = torch.relu(g)
    assert isinstance(out, gtmpi.Tensor)
    assert_same(out.detach(), torch.relu(x))
    assert_same(TF.gelu(g).detach(), TF.gelu(x))
    assert_same(torch.softmax(g, dim=-1).detach(), torch.softmax(x, dim=-1))
    assert_same(torch.cat([g, g], dim=0).detach(), torch.cat([x, x], dim=0))
    with pytest.raises(TypeError, match="torch.*stft.*no gtmpi equivalent"):
        torch.stft(g, 4)
    assert repr(g.sum().grad_fn).startswith("<SumBackward0 object at 0x")
    assert repr(gtmpi.tensor(x, requires_grad=True) * 2).endswith("grad_fn=<MulBackward0>)")
    xt = x.float().requires_grad_()
    gf = gtmpi.tensor(xt.detach(), requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    gw = gtmpi.tensor(w.detach(), requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    gb = gtmpi.tensor(b.detach(), requires_grad=True)
    y = torch.tensor([1, 0, 4])
    for fn in (lambda t, w, b: t * 2, lambda t, w, b: t + t, lambda t, w, b: t / 3,
               lambda t, w, b: t.relu(), lambda t, w, b: t.exp(), lambda t, w, b: t.mean(),
               lambda t, w, b: t @ w.T if isinstance(t, torch.Tensor) else t @ w.t(),
               lambda t, w, b: (TF if isinstance(t, torch.Tensor) else GF).linear(t, w, b),
               lambda t, w, b: (TF if isinstance(t, torch.Tensor) else GF).linear(t, w),
               lambda t, w, b: (TF if isinstance(t, torch.Tensor) else GF).cross_entropy(
                   (TF if isinstance(t, torch.Tensor) else GF).linear(t, w, b),
                   y if isinstance(t, torch.Tensor) else gtmpi.tensor(y)),
               lambda t, w, b: (TF if isinstance(t, torch.Tensor) else GF).layer_norm(t, (4,)),
               lambda t, w, b: t.to(torch.float64), lambda t, w, b: t.softmax(-1),
               lambda t, w, b: t.view(12), lambda t, w, b: t.transpose(0, 1),
               lambda t, w, b: t.masked_fill(t > 0, 0.0)):
        want = fn(xt, w, b).grad_fn.name()
        assert fn(gf, gw, gb).grad_fn.name() == want, want


# devices ------------------------------------------------------------------------------------

def test_device_idioms_are_accepted_and_keep_data_where_the_runtime_put_it():
    x = r(2, 3)
    g = gtmpi.tensor(x, device="cpu")
    assert g.device == HOME_DEVICE
    assert g.to("cpu") is g and g.cpu() is g and g.cuda() is g and g.to(g.device) is g
    assert g.to("cuda:0", torch.float32).dtype == torch.float32
    assert g.to(device="cpu", dtype=torch.float16).dtype == torch.float16
    assert g.to(gtmpi.zeros(1, dtype=torch.int32)).dtype == torch.int32
    for made in (gtmpi.zeros(2, device="cpu"), gtmpi.ones(2, device=HOME_DEVICE),
                 gtmpi.arange(3, device="cpu"), gtmpi.randn(2, device="cpu"),
                 gtmpi.zeros_like(g, device="cpu"), gtmpi.full((2,), 1.0, device="cpu"),
                 g.new_zeros(2, 2), g.new_ones((3,)), g.new_full((2,), 4.0), g.new_tensor([1.0])):
        assert made.device == HOME_DEVICE
    assert g.new_zeros(2, 2).dtype == torch.float64
    with pytest.raises(RuntimeError):
        gtmpi.zeros(2, device="not a device")
    device = "cuda" if gtmpi.cuda.is_available() else "cpu"
    assert device == HOME_DEVICE.type
    model = gnn.Linear(3, 2).to(device)
    assert model.weight.dtype == torch.float32
    assert model.to(torch.float64).weight.dtype == torch.float64


# nn ---------------------------------------------------------------------------------------

def test_functional_and_layer_forms_match_torch():
    x = r(4, 6).float()
    g = gtmpi.tensor(x)
    y = idx(4, high=6)
    assert_same(GF.tanh(g), torch.tanh(x))
    assert_same(GF.sigmoid(g), torch.sigmoid(x))
    assert_same(gnn.Tanh()(g), torch.nn.Tanh()(x))
    assert_same(gnn.Sigmoid()(g), torch.nn.Sigmoid()(x))
    assert_same(gnn.LeakyReLU(0.1)(g), torch.nn.LeakyReLU(0.1)(x))
    assert_same(gnn.Identity(3, k=1)(g), x)
    assert_same(gnn.Flatten()(g.view(4, 2, 3)), torch.nn.Flatten()(x.view(4, 2, 3)))
    assert_same(gnn.CrossEntropyLoss(label_smoothing=0.1)(g, gtmpi.tensor(y)),
                torch.nn.CrossEntropyLoss(label_smoothing=0.1)(x, y))
    assert_same(gnn.MSELoss(reduction="sum")(g, g * 2), torch.nn.MSELoss(reduction="sum")(x, x * 2))


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_matches_torch(batch_first, need_weights):
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first)
    g = gnn.MultiheadAttention(8, 2, batch_first=batch_first)
    assert list(g.state_dict()) == list(t.state_dict())
    g.load_state_dict(t.state_dict())
    q, kv = torch.randn(3, 5, 8), torch.randn(3, 7, 8)  # (N, L, E), (N, S, E)
    if not batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    mask = torch.ones(5, 7, dtype=torch.bool).triu(3)  # True: not attended, as in torch
    with torch.no_grad():
        want, want_w = t(q, kv, kv, attn_mask=mask, need_weights=need_weights)
    got, got_w = g(gtmpi.tensor(q), gtmpi.tensor(kv), gtmpi.tensor(kv),
                   attn_mask=gtmpi.tensor(mask), need_weights=need_weights)
    assert_same(got.detach(), want, rtol=1e-4, atol=1e-5)
    if need_weights:
        assert_same(got_w.detach(), want_w, rtol=1e-4, atol=1e-5)
    else:
        assert got_w is None


@pytest.mark.parametrize("kw", [{}, {"norm_first": True, "activation": "gelu", "batch_first": True},
                                {"activation": GF.gelu}])
def test_a_transformer_encoder_is_torchs(kw):
    """torch's submodules and keys; with torch's weights loaded, its outputs and gradients (in
    training, dropout off; masks and key padding given), and the same initial weights in
    every layer (deep copies of the one given)."""
    torch.manual_seed(0)
    lib_kw = {**kw, "activation": TF.gelu} if callable(kw.get("activation")) else kw

    def encoder(lib_nn, layer_kw):
        layer = lib_nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, **layer_kw)
        return lib_nn.TransformerEncoder(layer, 2, norm=lib_nn.LayerNorm(8))
    t, g = encoder(torch.nn, lib_kw), encoder(gnn, kw)
    assert list(g.state_dict()) == list(t.state_dict())
    assert torch.equal(g.layers[0].linear1.weight.cpu_torch(), g.layers[1].linear1.weight.cpu_torch())
    g.load_state_dict(t.state_dict())
    x = torch.randn(3, 5, 8) if kw.get("batch_first") else torch.randn(5, 3, 8)  # N=3, L=5
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 3:] = True
    tx = x.clone().requires_grad_()
    want = t(tx, mask=mask, src_key_padding_mask=padding)
    gx = gtmpi.tensor(x, requires_grad=True)
    got = g(gx, mask=gtmpi.tensor(mask), src_key_padding_mask=gtmpi.tensor(padding))
    assert_same(got.detach(), want.detach(), rtol=1e-4, atol=1e-5)
    want.pow(2).sum().backward()
    got.pow(2).sum().backward()
    assert_same(gx.grad, tx.grad, rtol=1e-4, atol=1e-4)
    for (name, gp), tp in zip(g.named_parameters(), t.parameters()):
        assert_same(gp.grad, tp.grad, rtol=1e-4, atol=1e-4)


def test_channel_dropout_drops_whole_channels_and_scales_the_rest():
    x = gtmpi.ones(8, 16, 5, 5)
    y = gnn.Dropout2d(0.5)(x).cpu_torch()
    per_channel = y.reshape(8, 16, -1)
    assert torch.all((per_channel == 0).all(-1) | (per_channel == 2.0).all(-1))
    assert 0.25 < (per_channel[..., 0] == 0).float().mean().item() < 0.75
    assert torch.equal(gnn.Dropout1d(0.3).eval()(x[0]).cpu_torch(), x[0].cpu_torch())
    with pytest.raises(RuntimeError, match="Expected 3D or 4D input"):
        GF.dropout2d(gtmpi.ones(2))


@pytest.mark.parametrize("name,kw,given", [
    ("LSTM", {"num_layers": 2, "batch_first": True}, False),
    ("LSTM", {"bidirectional": True, "bias": False}, True),
    ("GRU", {"num_layers": 2, "bidirectional": True, "dropout": 0.0}, False),
    ("GRU", {}, True)])
def test_recurrent_layers_are_torchs(name, kw, given):
    """LSTM and GRU: torch's parameter names and initial draws (the same seed, the same
    weights), outputs, final states and gradients, batched or not, states given or zeros."""
    torch.manual_seed(0)
    t = getattr(torch.nn, name)(5, 4, **kw)
    gtmpi.manual_seed(0)
    g = getattr(gnn, name)(5, 4, **kw)
    assert list(g.state_dict()) == list(t.state_dict())
    for mine, theirs in zip(g.parameters(), t.parameters()):
        assert torch.equal(mine.cpu_torch(), theirs.detach())
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    batch = 3 if kw.get("batch_first") else 6  # (3, 6, 5): N, L or L, N
    for shape, states in (((3, 6, 5), (layers, batch, 4)), ((6, 5), (layers, 4))):
        x = torch.randn(*shape)
        hx = [torch.randn(*states) for _ in range(2 if name == "LSTM" else 1)] if given else None
        tx = x.clone().requires_grad_()
        t_hx = None if hx is None else tuple(hx) if name == "LSTM" else hx[0]
        g_hx = None if hx is None else tuple(map(gtmpi.tensor, hx)) if name == "LSTM" else \
            gtmpi.tensor(hx[0])
        want, want_state = t(tx, t_hx)
        gx = gtmpi.tensor(x, requires_grad=True)
        got, got_state = g(gx, g_hx)
        assert_same(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
        for a, b in zip(got_state if name == "LSTM" else [got_state],
                        want_state if name == "LSTM" else [want_state]):
            assert_same(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        t.zero_grad()
        g.zero_grad()
        want.pow(2).sum().backward()
        got.pow(2).sum().backward()
        assert_same(gx.grad, tx.grad, rtol=1e-4, atol=1e-5)
        for mine, theirs in zip(g.parameters(), t.parameters()):
            assert_same(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)


def test_deepcopy_of_a_module_is_torchs():
    """copy.deepcopy(model) (an average of weights, a snapshot): new Parameters with the same
    values and gradients, beside the originals, that train apart; a non-leaf is refused."""
    import copy
    model = gnn.Sequential(gnn.Linear(3, 4), gnn.ReLU(), gnn.Linear(4, 2))
    model(gtmpi.ones(5, 3)).sum().backward()
    twin = copy.deepcopy(model)
    for mine, theirs in zip(twin.parameters(), model.parameters()):
        assert type(mine) is gnn.Parameter and mine is not theirs and mine.requires_grad
        assert torch.equal(mine.cpu_torch(), theirs.cpu_torch())
        assert torch.equal(mine.grad.cpu_torch(), theirs.grad.cpu_torch())
    before = [p.cpu_torch() for p in model.parameters()]
    opt = gtmpi.optim.SGD(twin.parameters(), lr=0.5)
    opt.step()
    assert all(torch.equal(p.cpu_torch(), b) for p, b in zip(model.parameters(), before))
    assert not torch.equal(twin[0].weight.cpu_torch(), before[0])
    shared = gtmpi.ones(2)
    a, b = copy.deepcopy([shared, shared])
    assert a is b  # one copy of one tensor, as the memo keeps it
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(gtmpi.ones(2, requires_grad=True) * 2)


@pytest.mark.parametrize("dims,kw", [(1, {}), (1, {"stride": 2, "padding": 1, "dilation": 2}),
                                     (2, {"padding": (1, 0), "groups": 2}), (2, {"stride": [2, 1]})])
def test_convolutions_match_torch(dims, kw):
    torch.manual_seed(0)
    t = (torch.nn.Conv1d if dims == 1 else torch.nn.Conv2d)(4, 6, 3, **kw)
    g = (gnn.Conv1d if dims == 1 else gnn.Conv2d)(4, 6, 3, **kw)
    assert [(n, p.shape) for n, p in g.named_parameters()] == \
        [(n, p.shape) for n, p in t.named_parameters()]
    bound = 1 / math.sqrt(4 // kw.get("groups", 1) * 3 ** dims)  # torch's default init
    assert 0.8 * bound < float(g.weight.detach().abs().max()) <= bound
    g.load_state_dict(t.state_dict())
    _same_output_and_gradients(g, t, torch.randn(2, 4, *(9,) * dims))


def _same_output_and_gradients(g, t, x: torch.Tensor) -> None:
    """A gtmpi layer and torch's (its weights loaded) on ``x``: the outputs, the input's
    gradient and the weight's and bias's."""
    gx = gtmpi.tensor(x, requires_grad=True)
    tx = x.clone().requires_grad_()
    got, want = g(gx), t(tx)
    assert_same(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    want.square().sum().backward()
    assert_same(gx.grad, tx.grad, rtol=1e-4, atol=1e-5)
    assert_same(g.weight.grad, t.weight.grad, rtol=1e-4, atol=1e-4)
    assert_same(g.bias.grad, t.bias.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dims,kw", [(1, {}), (1, {"stride": 2, "padding": 1, "output_padding": 1}),
                                     (2, {"stride": 2, "groups": 2, "dilation": 2}),
                                     (2, {"stride": (2, 1), "padding": (1, 0)})])
def test_transposed_convolutions_match_torch(dims, kw):
    """ConvTranspose1d/2d: torch's parameters (weight (in, out/groups, *kernel)) and
    initialisation bound, outputs and gradients, batched and unbatched."""
    torch.manual_seed(0)
    make = {1: "ConvTranspose1d", 2: "ConvTranspose2d"}[dims]
    t, g = getattr(torch.nn, make)(4, 6, 3, **kw), getattr(gnn, make)(4, 6, 3, **kw)
    assert [(n, p.shape) for n, p in g.named_parameters()] == \
        [(n, p.shape) for n, p in t.named_parameters()]
    bound = 1 / math.sqrt(6 // kw.get("groups", 1) * 3 ** dims)  # fan_in from out/groups
    assert 0.8 * bound < float(g.weight.detach().abs().max()) <= bound
    g.load_state_dict(t.state_dict())
    for x in (torch.randn(2, 4, *(5,) * dims), torch.randn(4, *(5,) * dims)):
        _same_output_and_gradients(g, t, x)


@pytest.mark.parametrize("name,args,kw,shape", [
    ("MaxPool2d", (2,), {}, (3, 4, 9, 9)),
    ("MaxPool2d", (3, 2, 1), {"ceil_mode": True}, (2, 3, 8, 8)),
    ("MaxPool2d", ((2, 3),), {"dilation": 2}, (3, 9, 11)),  # unbatched
    ("MaxPool1d", (3,), {"stride": 1}, (2, 4, 10)),
    ("AvgPool2d", (2,), {}, (2, 3, 8, 8)),
    ("AvgPool2d", (3, 2, 1), {"count_include_pad": False, "divisor_override": 5}, (2, 3, 7, 7)),
    ("AvgPool1d", (4,), {"ceil_mode": True}, (2, 3, 17)),
    ("AdaptiveAvgPool2d", ((1, 1),), {}, (2, 3, 7, 7)),
    ("AdaptiveAvgPool2d", ((3, None),), {}, (2, 3, 8, 6)),
    ("AdaptiveAvgPool1d", (5,), {}, (2, 3, 12)),
])
def test_pooling_layers_and_their_gradients_match_torch(name, args, kw, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    t, g = getattr(torch.nn, name)(*args, **kw), getattr(gnn, name)(*args, **kw)
    assert repr(g) == repr(t)
    tx, gx = x.clone().requires_grad_(), gtmpi.tensor(x, requires_grad=True)
    want, got = t(tx), g(gx)
    assert_same(got.detach(), want.detach(), rtol=0, atol=0)
    want.square().sum().backward()
    got.square().sum().backward()
    assert_same(gx.grad, tx.grad, rtol=0, atol=0)  # torch's own backward kernel, on the worker
    functional = {"MaxPool2d": "max_pool2d", "AvgPool1d": "avg_pool1d",
                  "AdaptiveAvgPool1d": "adaptive_avg_pool1d"}.get(name)
    if functional and not kw:  # the F form, torch's positional arguments
        assert_same(getattr(gnn.functional, functional)(gtmpi.tensor(x), *args).detach(),
                    getattr(torch.nn.functional, functional)(x, *args), rtol=0, atol=0)


def test_max_pooling_with_indices_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="return_indices"):
        gnn.MaxPool2d(2, return_indices=True)(gtmpi.zeros(1, 1, 4, 4))


@pytest.mark.parametrize("kind,shape", [("1d", (8, 3)), ("1d", (4, 3, 5)), ("2d", (4, 3, 5, 2))])
def test_batch_norm_trains_and_evaluates_as_torch(kind, shape):
    t = (torch.nn.BatchNorm1d if kind == "1d" else torch.nn.BatchNorm2d)(3, momentum=0.2)
    g = (gnn.BatchNorm1d if kind == "1d" else gnn.BatchNorm2d)(3, momentum=0.2)
    assert list(g.state_dict()) == list(t.state_dict())
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(*shape, generator=gen) * 2 + 1
        gx, tx = gtmpi.tensor(x, requires_grad=True), x.clone().requires_grad_()
        got, want = g(gx), t(tx)
        assert_same(got.detach(), want.detach(), rtol=1e-5, atol=1e-5)
        (got * got.detach().sign()).sum().backward()
        (want * want.detach().sign()).sum().backward()
        assert_same(gx.grad, tx.grad, rtol=1e-4, atol=1e-5)
    for name, value in t.state_dict().items():
        assert_same(g.state_dict()[name].detach(), value, rtol=1e-5, atol=1e-6)
    assert_same(g.weight.grad, t.weight.grad, rtol=1e-4, atol=1e-4)
    g.eval()
    t.eval()
    x = torch.randn(*shape, generator=gen)
    assert_same(g(gtmpi.tensor(x)).detach(), t(x).detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expected"):
        g(gtmpi.zeros(3))


def test_multihead_attention_key_padding_mask_matches_torch():
    torch.manual_seed(1)
    t = torch.nn.MultiheadAttention(8, 4, batch_first=True)
    g = gnn.MultiheadAttention(8, 4, batch_first=True)
    g.load_state_dict(t.state_dict())
    x = torch.randn(2, 6, 8)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    with torch.no_grad():
        want, _ = t(x, x, x, key_padding_mask=pad, need_weights=False)
    got, _ = g(gtmpi.tensor(x), gtmpi.tensor(x), gtmpi.tensor(x),
               key_padding_mask=gtmpi.tensor(pad), need_weights=False)
    assert_same(got.detach(), want, rtol=1e-4, atol=1e-5)


def test_module_apply_hooks_buffers_and_tied_weights_as_torch():
    def build(nn):
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(10, 4)
                self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
                self.head = nn.Linear(4, 10, bias=False)
                self.head.weight = self.emb.weight  # tied
                self.register_buffer("mask", torch.ones(3) if nn is torch.nn else
                                     gtmpi.ones(3))
                self.register_buffer("scratch", torch.zeros(2) if nn is torch.nn else
                                     gtmpi.zeros(2), persistent=False)
        return Net()

    t, g = build(torch.nn), build(gnn)
    assert [n for n, _ in g.named_parameters()] == [n for n, _ in t.named_parameters()]
    assert list(g.state_dict()) == list(t.state_dict())
    assert [n for n, _ in g.named_buffers()] == [n for n, _ in t.named_buffers()]
    assert [n for n, _ in g.named_modules()] == [n for n, _ in t.named_modules()]
    assert g.head.weight is g.emb.weight
    seen = []
    g.apply(lambda m: seen.append(type(m).__name__))
    order = []
    t.apply(lambda m: order.append(type(m).__name__))
    assert seen == order
    calls = []
    handle = g.body.register_forward_hook(lambda m, args, out: calls.append(out.shape) or out * 0)
    pre = g.body.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    out = g.body(gtmpi.ones(2, 4))
    assert calls == [torch.Size([2, 4])] and float(out.abs().sum()) == 0.0
    handle.remove()
    pre.remove()
    assert float(g.body(gtmpi.ones(2, 4)).abs().sum()) > 0
    result = g.load_state_dict({k: v for k, v in t.state_dict().items() if k != "mask"} |
                               {"extra": torch.zeros(1)}, strict=False)
    assert result.missing_keys == ["mask"] and result.unexpected_keys == ["extra"]
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "mask"'):
        g.load_state_dict({k: v for k, v in t.state_dict().items() if k != "mask"})
    assert_same(g.head.weight.detach(), t.head.weight.detach())


def test_nn_init_follows_torch_formulas():
    w = gtmpi.zeros(64, 128)
    gnn.init.xavier_uniform_(w)
    bound = math.sqrt(6 / (64 + 128))
    v = w.cpu_torch()
    assert float(v.abs().max()) <= bound and float(v.abs().max()) > 0.9 * bound
    gnn.init.kaiming_uniform_(w, a=math.sqrt(5))
    assert float(w.cpu_torch().abs().max()) <= 1 / math.sqrt(128)
    gnn.init.normal_(w, mean=1.0, std=0.02)
    assert abs(float(w.cpu_torch().mean()) - 1.0) < 2e-3
    gnn.init.trunc_normal_(w, std=0.02, a=-0.03, b=0.03)
    v = w.cpu_torch()
    assert float(v.abs().max()) <= 0.03 and 0.01 < float(v.std()) < 0.02
    gnn.init.zeros_(w)
    assert float(w.cpu_torch().abs().max()) == 0
    gnn.init.constant_(w, 0.5)
    assert float(w.cpu_torch().min()) == 0.5
    assert gnn.init.calculate_gain("relu") == torch.nn.init.calculate_gain("relu")
    assert gnn.init.calculate_gain("leaky_relu", 0.2) == torch.nn.init.calculate_gain("leaky_relu", 0.2)


def test_clip_grad_utilities_as_torch():
    x = r(4, 3)
    tp = torch.nn.Parameter(x.clone())
    gp = gnn.Parameter(gtmpi.tensor(x))
    (tp * tp * 3).sum().backward()
    (gp * gp * 3).sum().backward()
    assert_same(gnn.utils.clip_grad_norm_(gp, 1.0), torch.nn.utils.clip_grad_norm_(tp, 1.0))
    assert_same(gp.grad, tp.grad)
    gnn.utils.clip_grad_value_([gp], 0.1)
    torch.nn.utils.clip_grad_value_([tp], 0.1)
    assert_same(gp.grad, tp.grad)


# GT's documented forms --------------------------------------------------------------------

def test_gt_documented_forms():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = gtmpi.from_numpy(a, requires_grad=True)
    assert x.requires_grad and x.is_leaf
    loss = gnn.mse_loss(x * 2, gtmpi.from_numpy(a))
    loss.backward()
    assert_same(x.grad, torch.from_numpy(a) * 4 / 6 * 2 / 2)
    t = torch.from_numpy(a)
    assert_same(gtmpi.cat([x.detach(), x.detach()], axis=1), torch.cat([t, t], dim=1))
    parts = gtmpi.split(x.detach(), split_size=1, axis=0)
    assert len(parts) == 2 and parts[1].shape == (1, 3)
    assert x.detach().split(split_size=2, axis=1)[1].shape == (2, 1)
    assert_same(x.detach().transpose(), t.T)
    rows = gtmpi.from_numpy(np.arange(10, dtype=np.float32).reshape(5, 2))
    assert [c.data.numpy().shape for c in rows.split(split_size=2, dim=0)] == [(2, 2), (2, 2), (1, 2)]
    assert [c.shape[0] for c in rows.chunk(chunks=2, dim=0)] == [3, 2]
    h = gtmpi.from_numpy(a)
    assert_same(gnn.relu(h - 2), torch.relu(t - 2))
    assert_same(gnn.sigmoid(h), torch.sigmoid(t))


SCHEDULES = {
    **EVERYDAY_SCHEDULES,
    "LambdaLR": lambda o, lib: lib.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9 ** e),
    "StepLR": lambda o, lib: lib.optim.lr_scheduler.StepLR(o, 3, gamma=0.5),
    "CosineAnnealingLR": lambda o, lib: lib.optim.lr_scheduler.CosineAnnealingLR(o, 10, 1e-4),
    "OneCycleLR": lambda o, lib: lib.optim.lr_scheduler.OneCycleLR(o, 0.5, total_steps=20),
    "ReduceLROnPlateau": lambda o, lib: lib.optim.lr_scheduler.ReduceLROnPlateau(o, patience=1),
}


def _stepped(sched, n: int, start: int = 0) -> list[float]:
    lrs = []
    for i in range(start, start + n):
        if isinstance(sched, (torch.optim.lr_scheduler.ReduceLROnPlateau,
                              gtmpi.optim.lr_scheduler.ReduceLROnPlateau)):
            sched.step(5.0 - 0.1 * (i % 3 == 0))
        else:
            sched.optimizer.step()
            sched.step()
        lrs += sched.get_last_lr()
    return lrs


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_schedule_resumes_from_its_state_dict_as_torchs(tmp_path, name):
    """Saved after 7 steps with the optimizer and loaded into fresh ones (gtmpi.save and
    gtmpi.load between), a schedule goes on as one never stopped, and as torch's does; a
    state saved by torch's schedule loads into gtmpi's, and gtmpi's into torch's, and each
    goes on as torch's."""
    def fresh(lib):
        opt = lib.optim.SGD([(torch.nn if lib is torch else gnn).Parameter(lib.zeros(2))],
                            lr=0.1, momentum=0.9)
        return opt, SCHEDULES[name](opt, lib)
    topt, ts = fresh(torch)
    want = _stepped(ts, 12)
    gopt, gs = fresh(gtmpi)
    assert _stepped(gs, 7) == pytest.approx(want[:7], rel=1e-9)
    gtmpi.save({"opt": gopt.state_dict(), "sched": gs.state_dict()}, tmp_path / "ck.pt")
    saved = gtmpi.load(tmp_path / "ck.pt")
    gopt, gs = fresh(gtmpi)
    gopt.load_state_dict(saved["opt"])
    gs.load_state_dict(saved["sched"])
    assert _stepped(gs, 5, 7) == pytest.approx(want[7:], rel=1e-9)
    topt, ts = fresh(torch)
    _stepped(ts, 7)
    gopt, gs = fresh(gtmpi)
    gopt.load_state_dict(topt.state_dict())
    gs.load_state_dict(ts.state_dict())
    assert _stepped(gs, 5, 7) == pytest.approx(want[7:], rel=1e-9)
    topt, ts = fresh(torch)  # and the other way: torch's schedule takes gtmpi's state
    topt.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=False)["opt"])
    ts.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=False)["sched"])
    assert _stepped(ts, 5, 7) == pytest.approx(want[7:], rel=1e-9)


def test_setting_data_is_torchs():
    """``p.data = x``: the same Parameter (its module's, its optimizer's), now on x's storage
    (an in-place change of x shows in p), any shape; its grad flows and its update lands."""
    got = {}
    for lib in (torch, gtmpi):
        nn_ = torch.nn if lib is torch else gnn
        lib.manual_seed(0)
        lin = nn_.Linear(3, 2)
        opt = lib.optim.SGD(lin.parameters(), lr=0.5)
        weight = lin.weight
        new = lib.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        weight.data = new
        new.mul_(2)  # shared: the parameter sees it
        assert lin.weight is weight and lin.weight.requires_grad
        lin(lib.ones(1, 3)).sum().backward()
        opt.step()
        lin.bias.data = lib.zeros(3)  # another shape
        got[lib] = [t.detach().clone() if lib is torch else t.cpu_torch()
                    for t in (lin.weight, lin.weight.grad, new, lin.bias)]
    for g, w in zip(got[gtmpi], got[torch]):
        assert torch.equal(g, w)
    with pytest.raises(TypeError, match="data must be a Tensor"):
        gnn.Linear(2, 2).weight.data = [1.0]
