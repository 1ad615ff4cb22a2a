"""torch's fused kernels as single instructions: each one and its gradient against torch on
random inputs (fp32 and bf16; causal, non-causal and masked attention; ignore_index), the
instructions a forward and a backward take, where results and gradients live when rows or
heads are split over workers, the multi-tensor optimizer steps, and memory: what autograd
keeps alive and a training loop's memory from step to step."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import gtmpi
import gtmpi.nn as gnn
import gtmpi.nn.functional as GF
from conftest import HOME_DEVICE, assert_same
from test_autograd import grad_check, r
from test_placement import collectives, where

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from examples.gpt.model import Config, build  # noqa: E402  (the GPT of the benchmark)

TF = torch.nn.functional
WORKERS = sorted(gtmpi.info()["workers"])
HOME = WORKERS[0]
spread = pytest.mark.skipif(len(WORKERS) < 2, reason="needs 2 or more workers (the MPI suite)")


def pick(t, fn_torch, fn_gtmpi):
    return fn_torch if isinstance(t, torch.Tensor) else fn_gtmpi


def lib_f(t):
    return TF if isinstance(t, torch.Tensor) else GF


def ops_on_home() -> int:
    """Instructions of the op table the home worker has run (no frees, reads, stats)."""
    stats = gtmpi.debug.worker_stats()[HOME]
    return stats["ops"] - stats["control"]


TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


# values and gradients against torch --------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm(dtype, affine):
    x, w, b = r(3, 5, 16), r(16), r(16)
    args = {"both": (w, b), "weight": (w,), "none": ()}[affine]
    grad_check(lambda x, *wb: lib_f(x).layer_norm(x, (16,), *wb, eps=1e-5), x, *args,
               dtype=dtype, **TOLERANCE[dtype])
    # two normalized dims
    grad_check(lambda x, w: lib_f(x).layer_norm(x, (5, 16), w), x, r(5, 16), dtype=dtype,
               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm(dtype):
    grad_check(lambda x, w: lib_f(x).rms_norm(x, (16,), w), r(4, 16), r(16), dtype=dtype,
               **TOLERANCE[dtype])
    grad_check(lambda x: lib_f(x).rms_norm(x, (16,), eps=1e-3), r(2, 3, 16), dtype=dtype,
               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention(dtype, causal):
    q, k, v = r(2, 3, 8, 16), r(2, 3, 8, 16), r(2, 3, 8, 16)
    grad_check(lambda q, k, v: lib_f(q).scaled_dot_product_attention(q, k, v, is_causal=causal),
               q, k, v, dtype=dtype, **TOLERANCE[dtype])
    # keys longer than queries, and a scale of one's own
    grad_check(lambda q, k, v: lib_f(q).scaled_dot_product_attention(q, k, v, scale=0.3),
               r(2, 3, 5, 16), r(2, 3, 8, 16), r(2, 3, 8, 16), dtype=dtype, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_with_padding_masks(dtype):
    q, k, v = r(2, 3, 6, 16), r(2, 3, 6, 16), r(2, 3, 6, 16)
    lengths = torch.tensor([6, 4])
    keep = (torch.arange(6)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    bias = torch.where(keep, 0.0, -1e4).to(torch.float64)

    def boolean(q, k, v):
        mask = keep if isinstance(q, torch.Tensor) else gtmpi.tensor(keep)
        return lib_f(q).scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def additive(q, k, v):
        mask = bias.to(q.dtype) if isinstance(q, torch.Tensor) else gtmpi.tensor(bias).to(q.dtype)
        return lib_f(q).scaled_dot_product_attention(q, k, v, attn_mask=mask)

    grad_check(boolean, q, k, v, dtype=dtype, **TOLERANCE[dtype])
    grad_check(additive, q, k, v, dtype=dtype, **TOLERANCE[dtype])


def test_attention_dropout_follows_the_seed():
    q = r(1, 2, 8, 16).float()
    outs = []
    for _ in range(2):
        gtmpi.manual_seed(7)
        outs.append(GF.scaled_dot_product_attention(*(gtmpi.tensor(q),) * 3, dropout_p=0.5).numpy())
    assert (outs[0] == outs[1]).all()
    x = gtmpi.tensor(q, requires_grad=True)
    GF.scaled_dot_product_attention(x, x, x, dropout_p=0.5).sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(x.grad.cpu_torch()).all()


def test_attention_dropout_leaves_the_programs_own_draws_alone():
    """A CPU worker draws attention's mask from torch's default generator, which an embedded
    worker shares with the program: the program's own draws go on as without it."""
    q = gtmpi.tensor(r(1, 2, 8, 16).float())
    torch.manual_seed(3)
    first = torch.rand(4)
    GF.scaled_dot_product_attention(q, q, q, dropout_p=0.5).numpy()
    second = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(torch.cat([first, second]), torch.rand(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_embedding_with_padding_row(dtype):
    idx = torch.tensor([[0, 3, 1, 3], [2, 2, 0, 1]])
    grad_check(lambda w: lib_f(w).embedding(idx if isinstance(w, torch.Tensor) else gtmpi.tensor(idx), w),
               r(5, 8), dtype=dtype, **TOLERANCE[dtype])
    grad_check(lambda w: lib_f(w).embedding(idx if isinstance(w, torch.Tensor) else gtmpi.tensor(idx),
                                            w, padding_idx=-2), r(5, 8), dtype=dtype)
    torch.manual_seed(3)
    t, g = torch.nn.Embedding(5, 8, padding_idx=1), gnn.Embedding(5, 8, padding_idx=1)
    assert (g.weight[1].detach().numpy() == 0).all()
    g.load_state_dict(t.state_dict())
    assert_same(g(gtmpi.tensor(idx)), t(idx).detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_ignore_index_and_smoothing(dtype, reduction):
    target = torch.tensor([0, 6, -100, 2, 1, -100])
    for smoothing in (0.0, 0.1):
        grad_check(lambda x: lib_f(x).cross_entropy(
            x, target if isinstance(x, torch.Tensor) else gtmpi.tensor(target),
            ignore_index=-100, reduction=reduction, label_smoothing=smoothing),
            r(6, 7), dtype=dtype, **TOLERANCE[dtype])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_silu_gradients(approximate):
    grad_check(lambda x: lib_f(x).gelu(x, approximate=approximate), r(4, 6))
    grad_check(lambda x: lib_f(x).silu(x), r(4, 6))


# instructions -------------------------------------------------------------------------------

def test_each_fused_op_is_one_instruction_each_way():
    """Forward one instruction, backward one (torch's backward kernel), for every fused op
    (its operands on the workers beforehand: device="cuda")."""
    x = gtmpi.randn(2, 3, 8, 16, requires_grad=True, device="cuda")
    w = gtmpi.randn(16, requires_grad=True, device="cuda")
    b = gtmpi.randn(16, requires_grad=True, device="cuda")
    k, v = gtmpi.randn(2, 3, 8, 16, requires_grad=True, device="cuda"), gtmpi.randn(2, 3, 8, 16, requires_grad=True, device="cuda")
    idx = gtmpi.tensor([[1, 2], [0, 3]], device="cuda")
    table = gtmpi.randn(5, 16, requires_grad=True, device="cuda")
    target = gtmpi.tensor([1, 0, 4], device="cuda")
    logits = gtmpi.randn(3, 5, requires_grad=True, device="cuda")
    cases = [
        lambda: GF.layer_norm(x, (16,), w, b),
        lambda: GF.rms_norm(x, (16,), w),
        lambda: GF.scaled_dot_product_attention(x, k, v, is_causal=True),
        lambda: GF.embedding(idx, table),
        lambda: GF.cross_entropy(logits, target, reduction="sum"),
        lambda: GF.linear(x, table, None),
    ]
    for make in cases:
        before = ops_on_home()
        out = make()
        forward = ops_on_home() - before
        assert forward == 1, (make.__code__.co_firstlineno, forward)
        grad = gtmpi.ones(out.shape, device="cuda")
        for leaf in (x, w, b, k, v, table, logits):
            leaf.grad = None
        before = ops_on_home()
        out.backward(grad)
        ran = ops_on_home() - before
        assert ran == 1, (make.__code__.co_firstlineno, ran)  # leaves take its results


def test_a_gpt_block_step_takes_few_instructions():
    """The instruction count of one training step of a small GPT, the figure RESULTS.md tracks:
    3 blocks of attention and MLP in at most 95 instructions a block."""
    c = Config(vocab=32, seq=8, layers=3, heads=2, dim=16)
    model = build(gtmpi)(c)
    opt = gtmpi.optim.AdamW(model.parameters(), lr=1e-3)
    x = gtmpi.tensor(torch.randint(0, 32, (2, 8)))

    def step():
        opt.zero_grad()
        loss = model(x, x)
        loss.backward()
        opt.step()
        return loss

    step().item()
    before = ops_on_home()
    step().item()
    assert ops_on_home() - before < 95 * c.layers


# the GPT's first losses against torch ----------------------------------------------------------

def test_gpt_first_losses_equal_torch_at_tiny_size():
    c = Config(vocab=64, seq=16, layers=2, heads=4, dim=32)
    torch.manual_seed(0)
    t_model = build(torch)(c)
    g_model = build(gtmpi)(c)
    g_model.load_state_dict(t_model.state_dict())
    t_opt = torch.optim.AdamW(t_model.parameters(), lr=1e-2, weight_decay=0.1)
    g_opt = gtmpi.optim.AdamW(g_model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (4, 3, 17), generator=gen)
    t_losses, g_losses = [], []
    for batch in data:
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        t_opt.zero_grad()
        loss = t_model(x, y)
        loss.backward()
        t_opt.step()
        t_losses.append(loss.item())
        g_opt.zero_grad()
        loss = g_model(gtmpi.tensor(x), gtmpi.tensor(y))
        loss.backward()
        g_opt.step()
        g_losses.append(loss.item())
    tol = 1e-4 if HOME_DEVICE.type == "cpu" else 2e-3
    for a, b in zip(g_losses, t_losses):
        assert abs(a - b) <= tol * abs(b), (g_losses, t_losses)


# optimizers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, kw", [
    ("SGD", dict(lr=0.1)), ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("Adam", dict(lr=1e-2, weight_decay=0.01)), ("AdamW", dict(lr=1e-2, betas=(0.8, 0.9))),
    # torch's fused kernel (the default on GPU workers), against torch's own fused=True
    ("Adam", dict(lr=1e-2, weight_decay=0.01, fused=True)),
    ("AdamW", dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1, fused=True)),
])
def test_multi_tensor_steps_match_torch_in_one_instruction(name, kw):
    torch.manual_seed(2)
    t_model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    g_model = gnn.Sequential(gnn.Linear(6, 5), gnn.GELU(), gnn.Linear(5, 3))
    g_model.load_state_dict(t_model.state_dict())
    t_model[1] = torch.nn.GELU()
    t_opt = getattr(torch.optim, name)(t_model.parameters(), **kw)
    g_opt = getattr(gtmpi.optim, name)(g_model.parameters(), **kw)
    x = torch.randn(4, 6)
    for step in range(3):
        t_opt.zero_grad()
        t_model(x).pow(2).mean().backward()
        t_opt.step()
        g_opt.zero_grad()
        g_model(gtmpi.tensor(x)).pow(2).mean().backward()
        before = ops_on_home()
        g_opt.step()
        if step:  # the first step also makes the optimizer state
            assert ops_on_home() - before == 1
    for (name_, t), g in zip(t_model.state_dict().items(), g_model.state_dict().values()):
        assert_same(g, t, rtol=1e-5, atol=1e-6)


def test_adam_kernel_fused_where_asked_and_on_gpus():
    """The worker's Adam(W) kernel: fused=True is torch's fused kernel to the bit, False and
    None on a CPU torch's foreach arithmetic to the bit (they differ in bf16: the fused kernel
    rounds once); on meta tensors (a dry run, standing for GPUs) None takes the fused path,
    which makes no temporaries."""
    from gtmpi.ops.table import OPS
    torch.manual_seed(5)
    shapes = [(64, 48), (48,), (7, 3)]
    start = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    grads = [torch.randn(s).to(torch.bfloat16) for s in shapes]

    def run(fused, how):
        ps, ms, vs = [p.clone() for p in start], [torch.zeros_like(p) for p in start], \
            [torch.zeros_like(p) for p in start]
        for done in range(3):
            if how == "gtmpi":
                OPS["adam_foreach"].kernel(*ps, *grads, *ms, *vs, 1e-2, 0.9, 0.99, 1e-8, 0.1,
                                           True, 1, fused)
            else:
                opt = torch.optim.AdamW([torch.nn.Parameter(p) for p in ps], lr=1e-2,
                                        betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                                        **{how: True})
                for param, g, m, v in zip(opt.param_groups[0]["params"], grads, ms, vs):
                    param.grad = g
                    opt.state[param] = {"step": torch.tensor(float(done)), "exp_avg": m,
                                        "exp_avg_sq": v}
                opt.step()
                ps = [param.data for param in opt.param_groups[0]["params"]]
        return ps

    fused, foreach = run(True, "fused"), run(False, "foreach")
    assert any(not torch.equal(a, b) for a, b in zip(fused, foreach))
    for got, want in ((run(True, "gtmpi"), fused), (run(False, "gtmpi"), foreach),
                      (run(None, "gtmpi"), foreach)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    meta = [t.to("meta") for t in [*start, *grads, *start, *start]]
    assert OPS["adam_foreach"].kernel(*meta, 1e-2, 0.9, 0.99, 1e-8, 0.1, True, 1, None).is_meta


@pytest.mark.parametrize("name, kw", [("SGD", dict(lr=0.1, momentum=0.9)),
                                      ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
                                      ("RMSprop", dict(lr=1e-2, momentum=0.5, centered=True,
                                                       weight_decay=0.1)),
                                      ("RMSprop", dict(lr=1e-2)),
                                      ("Adagrad", dict(lr=0.1, lr_decay=0.01, weight_decay=0.1,
                                                       initial_accumulator_value=0.5))])
def test_optimizer_state_dict_is_torchs_both_ways(name, kw):
    """A checkpoint of the optimizer resumes the same updates: torch's state loads into
    gtmpi's and gtmpi's into torch's, with torch's keys."""
    torch.manual_seed(3)
    t_model = torch.nn.Linear(5, 3)
    g_model = gnn.Linear(5, 3)
    g_model.load_state_dict(t_model.state_dict())
    t_opt = getattr(torch.optim, name)(t_model.parameters(), **kw)
    g_opt = getattr(gtmpi.optim, name)(g_model.parameters(), **kw)
    xs = [torch.randn(4, 5) for _ in range(4)]
    for x in xs[:2]:
        for model, opt, inp in ((t_model, t_opt, x), (g_model, g_opt, gtmpi.tensor(x))):
            opt.zero_grad()
            model(inp).pow(2).mean().backward()
            opt.step()
    mine, theirs = g_opt.state_dict(), t_opt.state_dict()
    assert [g["params"] for g in mine["param_groups"]] == [[0, 1]]
    assert {i: sorted(s) for i, s in mine["state"].items()} == \
        {i: sorted(s) for i, s in theirs["state"].items()}
    # gtmpi's state into a fresh torch optimizer, torch's into a fresh gtmpi one
    t2, g2 = torch.nn.Linear(5, 3), gnn.Linear(5, 3)
    t2.load_state_dict(t_model.state_dict())
    g2.load_state_dict(t_model.state_dict())
    t2_opt = getattr(torch.optim, name)(t2.parameters(), **kw)
    t2_opt.load_state_dict({"state": {i: {k: v if k == "step" else v.cpu_torch()
                                          for k, v in s.items()} for i, s in mine["state"].items()},
                            "param_groups": theirs["param_groups"]})
    g2_opt = getattr(gtmpi.optim, name)(g2.parameters(), **kw)
    g2_opt.load_state_dict(theirs)
    for x in xs[2:]:
        for model, opt, inp in ((t_model, t_opt, x), (t2, t2_opt, x), (g2, g2_opt, gtmpi.tensor(x))):
            opt.zero_grad()
            model(inp).pow(2).mean().backward()
            opt.step()
    for key, want in t_model.state_dict().items():
        torch.testing.assert_close(t2.state_dict()[key], want, rtol=1e-5, atol=1e-6)
        assert_same(g2.state_dict()[key], want, rtol=1e-5, atol=1e-6)


def test_optimizer_state_is_keyed_by_the_parameter_as_torchs():
    """opt.state[p], as torch's users read it (a learning-rate finder, a logger of Adam's
    moments): {} before p's first step, its moments after, with torch's numbers."""
    torch.manual_seed(4)
    t_model = torch.nn.Linear(3, 2)
    g_model = gnn.Linear(3, 2)
    g_model.load_state_dict(t_model.state_dict())
    t_opt = torch.optim.AdamW(t_model.parameters(), lr=1e-2)
    g_opt = gtmpi.optim.AdamW(g_model.parameters(), lr=1e-2)
    assert g_opt.state[g_model.weight] == {} == t_opt.state[t_model.weight]
    x = torch.randn(4, 3)
    for model, opt, inp in ((t_model, t_opt, x), (g_model, g_opt, gtmpi.tensor(x))):
        model(inp).pow(2).mean().backward()
        opt.step()
    mine, theirs = g_opt.state[g_model.weight], t_opt.state[t_model.weight]
    assert sorted(mine) == sorted(theirs)
    assert_same(mine["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-5, atol=1e-8)
    assert g_model.bias in g_opt.state and len(g_opt.state) == 2


def test_zero_grad_without_none_is_one_instruction():
    model = gnn.Sequential(gnn.Linear(4, 4), gnn.Linear(4, 2))
    model(gtmpi.randn(3, 4)).sum().backward()
    # the first zero_grad after a raised failure (earlier tests raise some) makes gradients
    # afresh, one op each (test_faults.py); every other is one instruction
    model.zero_grad(set_to_none=False)
    model(gtmpi.randn(3, 4)).sum().backward()
    before = ops_on_home()
    model.zero_grad(set_to_none=False)
    assert ops_on_home() - before == 1
    assert all((p.grad.numpy() == 0).all() for p in model.parameters())


# memory ------------------------------------------------------------------------------------------

def memory() -> int:
    gtmpi.synchronize()
    return gtmpi.debug.worker_stats()[HOME]["memory_bytes"]


def test_backward_frees_what_the_graph_saved():
    layer = gnn.Linear(256, 256)
    norm = gnn.LayerNorm(256)
    x = gtmpi.randn(64, 256)
    params = (*layer.parameters(), *norm.parameters())

    def forward():
        h = norm(layer(x).relu()).view(4, 16, 256)
        return GF.scaled_dot_product_attention(h, h, h, is_causal=True).sum()

    forward().backward()  # a GPU's first kernels make their workspaces
    for p in params:
        p.grad = None
    base = memory()
    out = forward()
    assert memory() > base + 3 * 64 * 256 * 4  # the activations the gradients need stay alive
    out.backward()
    grads = sum(p.numel() * 4 for p in params)
    assert memory() <= base + grads + 4096  # all of it freed by backward; the loss remains
    del out
    for p in params:
        p.grad = None
    assert memory() <= base + 4096


def test_a_dropped_graph_frees_its_saved_tensors(monkeypatch):
    monkeypatch.setenv("GTMPI_CAPTURE", "0")  # the layer's own records, not a captured call's
    layer = gnn.Linear(128, 128)
    x = gtmpi.randn(32, 128)
    GF.gelu(layer(x)).sum().backward()
    layer.weight.grad = layer.bias.grad = None
    base = memory()
    loss = GF.gelu(layer(x)).sum()
    assert memory() > base + 32 * 128 * 4
    del loss
    assert memory() <= base


def test_cross_entropy_keeps_log_probabilities_not_logits():
    """torch's record of cross-entropy keeps the log-probabilities; the logits die with their
    last handle (a GPT's logits are its largest activation)."""
    w = gtmpi.randn(256, 1000, requires_grad=True)
    target = gtmpi.tensor(torch.randint(0, 1000, (256,)))
    GF.cross_entropy(w * 1.0, target).backward()
    w.grad = None
    base = memory()
    logits = w * 1.0
    loss = GF.cross_entropy(logits, target)
    with_logits = memory()
    del logits
    assert memory() <= with_logits - 256 * 1000 * 4
    loss.backward()
    del loss
    w.grad = None
    assert memory() <= base


def test_training_loop_memory_returns_to_one_level_every_step():
    torch.manual_seed(0)
    model = gnn.Sequential(gnn.Linear(32, 64), gnn.GELU(), gnn.LayerNorm(64), gnn.Linear(64, 10))
    opt = gtmpi.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = gtmpi.randn(16, 32), gtmpi.tensor(torch.randint(0, 10, (16,)))
    levels = []
    for _ in range(6):
        opt.zero_grad()
        loss = GF.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        del loss
        levels.append(memory())
    assert len(set(levels[1:])) == 1, levels  # after the first step made the optimizer state


# placement: rows and heads split over workers --------------------------------------------------

@spread
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "embedding", "attention_batch",
                                "attention_heads"])
def test_fused_ops_keep_split_rows_and_heads(op):
    pair = WORKERS[:2]
    gtmpi.load_config({"rows": {"shard": {"axis": 0, "workers": [0, 1]}},
                       "heads": {"shard": {"axis": 1, "workers": [0, 1]}},
                       "whole": {"shard": {"workers": [0, 1], "replicated": True}}})
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 2, 6, 8, generator=gen)
    w = torch.randn(8, generator=gen)
    idx = torch.randint(0, 8, (4, 6), generator=gen)
    table = torch.randn(8, 8, generator=gen)
    t_leaves = {"x": x.clone().requires_grad_(), "w": w.clone().requires_grad_(),
                "table": table.clone().requires_grad_()}
    split = "heads" if op == "attention_heads" else "rows"
    dim = 1 if op == "attention_heads" else 0
    g_x = gtmpi.signal.tensor(x, split).requires_grad_()
    g_w = gtmpi.signal.tensor(w, "whole").requires_grad_()
    g_table = gtmpi.signal.tensor(table, "whole").requires_grad_()
    g_idx = gtmpi.signal.tensor(idx, "rows")
    fn = {
        "layer_norm": lambda F, x, w, t, i: F.layer_norm(x, (8,), w, w),
        "rms_norm": lambda F, x, w, t, i: F.rms_norm(x, (8,), w),
        "embedding": lambda F, x, w, t, i: F.embedding(i, t),
        "attention_batch": lambda F, x, w, t, i: F.scaled_dot_product_attention(x, x, x, is_causal=True),
        "attention_heads": lambda F, x, w, t, i: F.scaled_dot_product_attention(x, x, x, is_causal=True),
    }[op]
    before = collectives()
    out = fn(GF, g_x, g_w, g_table, g_idx)
    assert where(out) == f"S({dim})@{pair}"
    assert collectives() == before  # the forward moved nothing
    want = fn(TF, t_leaves["x"], t_leaves["w"], t_leaves["table"], idx)
    assert_same(out, want.detach(), rtol=1e-4, atol=1e-5)
    weights = gtmpi.signal.tensor(torch.randn(want.shape, generator=gen),
                                  split if out.ndim == 4 else "rows")
    before = collectives()
    (out * weights).sum().backward()
    ran = {k for k, v in collectives().items() if v != before.get(k, 0)}
    # the loss's sum, and the whole weights' gradients (partial sums) summed as one bucket
    assert ran <= {"all_reduce"}, ran
    (want * weights.cpu_torch()).sum().backward()
    used = {"layer_norm": ["x", "w"], "rms_norm": ["x", "w"], "embedding": ["table"]}.get(op, ["x"])
    for name in used:
        g_leaf = {"x": g_x, "w": g_w, "table": g_table}[name]
        kind = f"S({dim})" if name == "x" else "R"  # a whole weight's gradient: summed
        assert where(g_leaf.grad) == f"{kind}@{pair}", name
        assert_same(g_leaf.grad, t_leaves[name].grad, rtol=1e-4, atol=1e-5)
