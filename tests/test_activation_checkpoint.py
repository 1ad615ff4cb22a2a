"""Activation checkpointing (gtmpi.utils.checkpoint, torch's API): the gradients of a model
with its blocks checkpointed are those without (dropout's masks drawn again alike), as written
and replayed, on one worker and data parallel; between forward and backward the workers hold
only the blocks' inputs; and gtmpi.autograd.grad, which its recompute uses, is torch's."""
from __future__ import annotations

import functools

import pytest
import torch

import gtmpi
from conftest import assert_same
from gtmpi.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

WORKERS = sorted(gtmpi.info()["workers"])


def _model(lib, seed: int = 0):
    (torch.manual_seed if lib is torch else gtmpi.manual_seed)(seed)
    nn = lib.nn
    blocks = [nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.Dropout(0.25))
              for _ in range(4)]
    return blocks, nn.Linear(8, 1)


def _loss(blocks, head, x, how):
    h = x
    if how == "sequential":
        h = checkpoint_sequential(blocks, 2, h, use_reentrant=False)
    else:
        for b in blocks:
            h = checkpoint(b, h, use_reentrant=False) if how == "each" else b(h)
    return head(h).square().mean()


def _grads(blocks, head, x):
    return [p.grad.cpu_torch() for m in [*blocks, head] for p in m.parameters()] + \
        ([x.grad.cpu_torch()] if x.requires_grad else [])


@pytest.mark.parametrize("how", ["each", "sequential"])
@pytest.mark.parametrize("input_grad", [True, False])
def test_checkpointed_blocks_give_the_gradients_of_the_model_without(how, input_grad):
    host = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    runs = []
    for mode in ("none", how):
        blocks, head = _model(gtmpi)
        x = gtmpi.tensor(host, requires_grad=input_grad)
        losses = []
        for _ in range(2):  # the second step's draws: the recompute moved nothing on
            for m in [*blocks, head]:
                m.zero_grad()
            loss = _loss(blocks, head, x, mode)
            loss.backward()
            losses.append(loss.item())
        runs.append((losses, _grads(blocks, head, x)))
    (want_losses, want), (got_losses, got) = runs
    assert got_losses == want_losses and len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_without_dropout_the_gradients_are_torchs():
    host = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    t_blocks, t_head = _model(torch)
    g_blocks, g_head = _model(gtmpi)
    for t, g in zip([*t_blocks, t_head], [*g_blocks, g_head]):
        t.eval()
        g.eval()
        g.load_state_dict(t.state_dict())
    tx, gx = host.clone().requires_grad_(), gtmpi.tensor(host, requires_grad=True)
    h = tx
    for b in t_blocks:
        h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False)
    t_head(h).square().mean().backward()
    _loss(g_blocks, g_head, gx, "each").backward()
    _same_grads([*t_blocks, t_head, tx], [*g_blocks, g_head, gx])


def _same_grads(theirs: list, ours: list) -> None:
    """torch's modules and input (last) against gtmpi's: the same gradients."""
    for t, g in zip(theirs[:-1], ours[:-1]):
        for tp, gp in zip(t.parameters(), g.parameters()):
            assert_same(gp.grad, tp.grad, rtol=1e-5, atol=1e-6)
    assert_same(ours[-1].grad, theirs[-1].grad, rtol=1e-5, atol=1e-6)


def test_a_function_of_several_inputs_and_outputs_and_the_rng_left_free():
    w = gtmpi.ones(4, requires_grad=True)

    def f(a, b, scale):
        return a * w * scale, "note", (b * w).sum()

    a, b = gtmpi.full((4,), 2.0, requires_grad=True), gtmpi.full((4,), 3.0)
    out, note, total = checkpoint(f, a, b, 2.0, use_reentrant=False)
    assert note == "note" and total.item() == 12.0
    (out.sum() + total).backward()
    assert a.grad.tolist() == [2.0] * 4 and w.grad.tolist() == [7.0] * 4 and b.grad is None
    with gtmpi.no_grad():  # no graph wanted: the function runs as written
        assert checkpoint(f, a, b, 1.0)[2].item() == 12.0
    drop = gtmpi.nn.Dropout(0.5)
    x = gtmpi.ones(64, requires_grad=True)
    checkpoint(drop, x, preserve_rng_state=False).sum().backward()
    assert set(x.grad.tolist()) <= {0.0, 2.0}  # a mask of its own: not the forward's


def test_between_forward_and_backward_only_the_blocks_inputs_are_held():
    host = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))

    def held() -> int:
        gtmpi.synchronize()
        return sum(s["tensors"] for s in gtmpi.debug.worker_stats().values())

    counts = {}
    for how in ("none", "each"):
        blocks, head = _model(gtmpi)
        for m in [*blocks, head]:
            m.to("cuda")  # the weights on the workers now, not at their first use
        x = gtmpi.tensor(host).to("cuda")
        before = held()
        loss = _loss(blocks, head, x, how)
        counts[how] = held() - before
        loss.backward()
    # one output per block and the loss, against every block's saved tensors: its two
    # linears' inputs, GELU's input and dropout's mask (what torch saves)
    assert counts["each"] <= 4 + 2 and counts["none"] >= 4 * 4, counts


def test_a_replayed_step_with_checkpointed_blocks_gives_the_steps_as_written():
    host = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))
    runs = []
    for replay in (False, True):
        blocks, head = _model(gtmpi)
        opt = gtmpi.optim.SGD([p for m in [*blocks, head] for p in m.parameters()], lr=0.1)

        def step(x):
            loss = _loss(blocks, head, x, "each")
            loss.backward()
            return loss

        run = gtmpi.replayable(step) if replay else step
        x = gtmpi.tensor(host)
        losses = []
        for _ in range(5):
            opt.zero_grad()
            losses.append(run(x).item())
            opt.step()
        runs.append(losses)
        if replay:
            assert run.replays == 3
    assert runs[0] == pytest.approx(runs[1], rel=1e-6, abs=1e-7)


@pytest.mark.skipif(len(WORKERS) < 2, reason="needs 2 or more workers (the MPI suite)")
def test_data_parallel_checkpointed_blocks_reduce_gradients_in_strict_placement():
    host = torch.randn(8, 8, generator=torch.Generator().manual_seed(5))
    gtmpi.load_config({"ck_data": {"shard": {"axis": 0, "workers": [0, 1]}},
                       "ck_weights": {"shard": {"workers": [0, 1], "replicated": True}}})
    grads = []
    for split in (False, True):
        blocks, head = _model(gtmpi)
        if split:
            for m in [*blocks, head]:
                gtmpi.signal.place(m, "ck_weights")
        x = gtmpi.signal.tensor(host, "ck_data") if split else gtmpi.tensor(host)
        gtmpi.debug.strict_placement(split)
        try:
            _loss(blocks, head, x, "each" if split else "none").backward()
        finally:
            gtmpi.debug.strict_placement(False)
        grads.append(_grads(blocks, head, x))
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _normed(lib):
    (torch.manual_seed if lib is torch else gtmpi.manual_seed)(0)
    nn = lib.nn
    return [nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
            for _ in range(2)], nn.Linear(8, 1)


def _issued(monkeypatch) -> list[str]:
    """The names of the instructions the client issues from now on."""
    from gtmpi.client.runtime import runtime
    dispatcher, names = runtime().dispatcher, []
    submit = dispatcher.submit

    def noting(ins, *args, **kwargs):
        names.append(ins[0])
        return submit(ins, *args, **kwargs)
    monkeypatch.setattr(dispatcher, "submit", noting)
    return names


@pytest.mark.parametrize("policy", ["list", "function"])
def test_selective_checkpointing_keeps_the_matmuls_and_recomputes_the_rest(monkeypatch, policy):
    """torch's selective checkpointing API (Megatron's selective recompute): the outputs of the
    ops the policy saves are kept from the forward, and the recompute runs every other op of
    the block (norm, GELU) but none of those; the gradients are torch's without checkpointing."""
    def keep_linears(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == "linear" else \
            CheckpointPolicy.PREFER_RECOMPUTE
    context = functools.partial(create_selective_checkpoint_contexts,
                                ["linear"] if policy == "list" else keep_linears)
    host = torch.randn(6, 8, generator=torch.Generator().manual_seed(8))
    t_blocks, t_head = _normed(torch)
    g_blocks, g_head = _normed(gtmpi)
    for t, g in zip([*t_blocks, t_head], [*g_blocks, g_head]):
        g.load_state_dict(t.state_dict())
    tx, gx = host.clone().requires_grad_(), gtmpi.tensor(host, requires_grad=True)
    h = tx
    for b in t_blocks:
        h = b(h)
    t_head(h).square().mean().backward()
    h = gx
    for b in g_blocks:
        h = checkpoint(b, h, use_reentrant=False, context_fn=context)
    loss = g_head(h).square().mean()
    issued = _issued(monkeypatch)
    loss.backward()
    assert issued.count("layer_norm") == 2 and issued.count("gelu") == 2, issued
    assert "linear" not in issued, issued  # kept: only their gradients' matmuls run
    _same_grads([*t_blocks, t_head, tx], [*g_blocks, g_head, gx])


def test_a_selective_recompute_that_runs_other_ops_is_an_error():
    w = gtmpi.ones(4, requires_grad=True)
    runs = []

    def f(x):
        runs.append(1)
        return x @ w[:, None] if len(runs) > 1 else gtmpi.nn.functional.linear(x, w[None])

    out = checkpoint(f, gtmpi.ones(2, 4), use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                  [gtmpi.nn.functional.linear]))
    with pytest.raises(RuntimeError, match="must run the same ops again"):
        out.sum().backward()


def test_autograd_grad_is_torchs_and_leaves_grad_alone():
    host = torch.randn(3, 4, generator=torch.Generator().manual_seed(6))
    tx, gx = host.clone().requires_grad_(), gtmpi.tensor(host, requires_grad=True)
    tw, gw = torch.ones(4, requires_grad=True), gtmpi.ones(4, requires_grad=True)
    want = torch.autograd.grad([(tx * tw).sum(), (tx * tw).exp()], [tx, tw],
                               [None, torch.full((3, 4), 0.5)])
    got = gtmpi.autograd.grad([(gx * gw).sum(), (gx * gw).exp()], [gx, gw],
                              [None, gtmpi.full((3, 4), 0.5)])
    for g, w in zip(got, want):
        assert_same(g, w, rtol=1e-5, atol=1e-6)
    assert gx.grad is None and gw.grad is None
    unused = gtmpi.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="appears to not have been used"):
        gtmpi.autograd.grad((gx * 2).sum(), [gx, unused])
    assert gtmpi.autograd.grad((gx * 2).sum(), [gx, unused], allow_unused=True)[1] is None


def test_the_gpt_examples_checkpointed_blocks_give_its_losses_and_gradients():
    """examples/gpt's model with --checkpoint-activations full and selective
    (model.checkpointing), as written and replayed, against the same model keeping its
    activations."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from examples.gpt.model import SIZES, build
    c = SIZES["tiny"]
    data = torch.randint(0, c.vocab, (2, 4, c.seq + 1), generator=torch.Generator().manual_seed(7))
    runs = []
    for checkpointing in (None, "full", "selective"):
        gtmpi.manual_seed(0)
        model = build(gtmpi)(c)
        model.checkpointing = checkpointing

        @gtmpi.replayable
        def step(x, y):
            loss = model(x, y)
            loss.backward()
            return loss

        losses = []
        for i in range(4):
            model.zero_grad()
            d = data[i % 2]
            losses.append(step(gtmpi.tensor(d[:, :-1]), gtmpi.tensor(d[:, 1:])).item())
        runs.append((losses, [p.grad.cpu_torch() for p in model.parameters()]))
    for losses, grads in runs[1:]:
        assert losses == pytest.approx(runs[0][0], rel=1e-6)
        for g, w in zip(grads, runs[0][1]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


_TORCH_HAS_IT = hasattr(torch.nn, "LinearCrossEntropyOptions")  # torch 2.13 on


@pytest.mark.parametrize("reduction, smoothing, reference", [
    ("mean", 0.0, "composite"), ("sum", 0.0, "composite"), ("none", 0.0, "composite"),
    ("mean", 0.1, "composite"),
    *((reduction, 0.0, "torch's") for reduction in ("mean", "sum", "none") if _TORCH_HAS_IT)])
def test_a_chunked_head_and_loss_is_torchs(reduction, smoothing, reference):
    """Against torch's linear then cross_entropy, and against torch 2.13's own
    linear_cross_entropy with its own options object, given to gtmpi unchanged."""
    gen = torch.Generator().manual_seed(8)
    x, w, b = torch.randn(24, 16, generator=gen), torch.randn(50, 16, generator=gen), \
        torch.randn(50, generator=gen)
    t = torch.randint(0, 50, (24,), generator=gen)
    t[5] = 3
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=10) \
        if reference == "torch's" else gtmpi.nn.LinearCrossEntropyOptions(batch_chunk_size=10)
    tx, tw, tb = (v.clone().requires_grad_() for v in (x, w, b))
    F = torch.nn.functional
    want = F.linear_cross_entropy(tx, tw, t, linear_bias=tb, ignore_index=3, reduction=reduction,
                                  options=options) if reference == "torch's" else \
        F.cross_entropy(F.linear(tx, tw, tb), t, ignore_index=3, reduction=reduction,
                        label_smoothing=smoothing)
    gx, gw, gb = (gtmpi.tensor(v, requires_grad=True) for v in (x, w, b))
    got = gtmpi.nn.functional.linear_cross_entropy(
        gx, gw, gtmpi.tensor(t), linear_bias=gb, ignore_index=3, reduction=reduction,
        label_smoothing=smoothing, options=options)
    assert_same(got, want.detach(), rtol=1e-5, atol=1e-6)
    upstream = torch.rand(want.shape, generator=gen)
    (want * upstream).sum().backward()
    (got * gtmpi.tensor(upstream)).sum().backward()
    for g, v in ((gx, tx), (gw, tw), (gb, tb)):
        assert_same(g.grad, v.grad, rtol=1e-5, atol=1e-5)


def test_a_chunked_loss_holds_gradients_not_logits():
    """On a dry run's worker, which counts every byte its kernels make and free: after the
    forward, the loss's record holds the input's and the weight's gradients and nothing the
    size of the logits; twice the rows raise the peak by row-sized tensors alone."""
    from gtmpi.transport.local import LocalLink
    from gtmpi.worker.metaplane import MetaExecutor
    vocab, dim, peaks = 8192, 64, []
    for rows in (1024, 2048):
        ex = MetaExecutor(1, LocalLink())
        ex.run([("zeros", 1, ((rows, dim), torch.float32), 0, {}),
                ("zeros", 2, ((vocab, dim), torch.float32), 0, {}),
                ("zeros", 3, ((rows,), torch.int64), 0, {})])
        base = ex.meta_peak
        ex.run([("linear_cross_entropy", (4, 5), (1, 2, 3, None, -100, "mean", 128), 7,
                 {"grads": (0, 1)})])
        assert ex._made.alive - base == (rows * dim + vocab * dim) * 4 + 4  # dx, dw, the loss
        peaks.append(ex.meta_peak - base)
        like = (((rows, dim), torch.float32), ((vocab, dim), torch.float32))
        ex.run([("linear_cross_entropy_grad", (6, 7), (5, 4), 3, {"grads": (0, 1), "like": like})])
        assert ex.meta_peak - base == peaks[-1]  # backward scales what forward made
    assert peaks[0] < 2 * vocab * dim * 4 + 4 * 128 * vocab * 4  # not 1,024 rows' logits (32 MiB)
    assert peaks[1] - peaks[0] < 2 * 1024 * dim * 4  # the extra rows' input and gradient


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_chunked_loss_under_autocast_is_the_whole_logits_loss(device_type):
    """Under autocast the head's matmuls run in bfloat16 and the loss is float32 as torch's
    lists make it: on CPUs cross_entropy in float32; on GPUs torch's composite, whose
    log_softmax rounds the log-probabilities to bfloat16 (the regions' rules, set against
    torch's in test_amp.py, stand for both here: CPU workers run either)."""
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(64, 32, generator=gen), torch.randn(300, 32, generator=gen) / 4
    t = torch.randint(0, 300, (64,), generator=gen)
    t[3] = -100
    runs = []
    for chunked in (False, True):
        gx, gw = (gtmpi.tensor(v, requires_grad=True) for v in (x, w))
        with gtmpi.autocast(device_type, dtype=gtmpi.bfloat16):
            if chunked:
                loss = gtmpi.nn.functional.linear_cross_entropy(
                    gx, gw, gtmpi.tensor(t),
                    options=gtmpi.nn.LinearCrossEntropyOptions(batch_chunk_size=16))
            else:
                loss = gtmpi.nn.functional.cross_entropy(gtmpi.nn.functional.linear(gx, gw),
                                                         gtmpi.tensor(t))
        loss.backward()
        runs.append((loss.dtype, loss.item(), gx.grad.cpu_torch(), gw.grad.cpu_torch()))
    (dtype, want, wx, ww), (got_dtype, got, gx_, gw_) = runs
    assert got_dtype == dtype == torch.float32
    assert got == pytest.approx(want, rel=1e-5)
    torch.testing.assert_close(gx_, wx, rtol=2e-2, atol=1e-4)  # bfloat16 gradients
    torch.testing.assert_close(gw_, ww, rtol=2e-2, atol=1e-4)


def test_a_recompute_runs_under_the_forwards_autocast():
    """Backward outside the autocast region recomputes a checkpointed block under the region
    its forward ran in, as torch's checkpoint does: the gradients are those of the block kept
    (bit for bit) and torch's own under torch.autocast with torch.utils.checkpoint."""
    grads = {}
    for lib, how in ((gtmpi, "kept"), (gtmpi, "each"), (torch, "each")):
        blocks, head = _model(lib, seed=3)
        # no dropout: torch and gtmpi draw masks apart
        blocks = [lib.nn.Sequential(*list(b)[:3]) for b in blocks]
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(16, 8, generator=gen)
        x = gtmpi.tensor(x) if lib is gtmpi else x
        with lib.autocast("cpu", dtype=lib.bfloat16):
            h = x
            for b in blocks:
                h = b(h) if how == "kept" else (
                    checkpoint(b, h, use_reentrant=False) if lib is gtmpi else
                    torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False))
            loss = head(h).float().square().mean()
        loss.backward()
        grads[lib.__name__, how] = [p.grad.cpu_torch() if lib is gtmpi else p.grad
                                    for m in [*blocks, head] for p in m.parameters()]
    kept, each, ref = grads["gtmpi", "kept"], grads["gtmpi", "each"], grads["torch", "each"]
    for k, e, r in zip(kept, each, ref):
        assert k.dtype == torch.float32 and torch.equal(k, e)
        torch.testing.assert_close(e, r, rtol=2e-2, atol=1e-3)  # bfloat16's rounding


@pytest.mark.skipif(len(WORKERS) < 2, reason="needs 2 or more workers (the MPI suite)")
def test_a_chunked_loss_keeps_a_split_batch_split():
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(32, 16, generator=gen), torch.randn(40, 16, generator=gen)
    t = torch.randint(0, 40, (32,), generator=gen)
    gtmpi.load_config({"ck_data": {"shard": {"axis": 0, "workers": [0, 1]}},
                       "ck_weights": {"shard": {"workers": [0, 1], "replicated": True}}})
    gx = gtmpi.signal.tensor(x, "ck_data").requires_grad_()
    gw = gtmpi.signal.tensor(w, "ck_weights").requires_grad_()
    gtmpi.debug.strict_placement()
    try:
        loss = gtmpi.nn.functional.linear_cross_entropy(
            gx, gw, gtmpi.signal.tensor(t, "ck_data"),
            options=gtmpi.nn.LinearCrossEntropyOptions(batch_chunk_size=4))
        loss.backward()
    finally:
        gtmpi.debug.strict_placement(False)
    tx, tw = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(tx @ tw.T, t)
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-5
    assert_same(gx.grad, tx.grad, rtol=1e-5, atol=1e-6)
    assert_same(gw.grad, tw.grad, rtol=1e-5, atol=1e-6)


def test_the_gpt_examples_chunked_loss_gives_its_losses_and_gradients():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from examples.gpt.model import SIZES, build
    c = SIZES["tiny"]
    d = torch.randint(0, c.vocab, (4, c.seq + 1), generator=torch.Generator().manual_seed(10))
    runs = []
    for rows in (None, 64):
        gtmpi.manual_seed(0)
        model = build(gtmpi)(c)
        model.loss_chunk_rows = rows
        loss = model(gtmpi.tensor(d[:, :-1]), gtmpi.tensor(d[:, 1:]))
        loss.backward()
        runs.append((loss.item(), [p.grad.cpu_torch() for p in model.parameters()]))
    assert runs[1][0] == pytest.approx(runs[0][0], rel=1e-6)
    for g, w in zip(runs[1][1], runs[0][1]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_chunks_are_sized_as_torchs_options_size_them():
    from gtmpi.nn.functional import _chunk_rows
    options = gtmpi.nn.LinearCrossEntropyOptions
    x, head = gtmpi.empty(8192, 768), gtmpi.empty(50304, 768)
    # GPT-2 small at batch 8: 66 times the input's width in classes, so 8,192 / 66 rows
    # (128, a power of two) make logits as large as the input; "auto" halves them
    assert _chunk_rows(options(chunking_method="aspect_ratio"), x, head) == 128
    assert _chunk_rows(options(), x, head) == 64
    assert _chunk_rows(options(chunking_method="aspect_ratio:4"), x, head) == 32
    assert _chunk_rows(options(batch_chunk_size=1024), x, head) == 1024
    assert _chunk_rows(options(chunking_method=None), x, head) == 8192
    with pytest.raises(ValueError, match="both set"):
        _chunk_rows(options(batch_chunk_size=8, chunking_method="aspect_ratio"), x, head)
    with pytest.raises(ValueError, match="unknown chunking_method"):
        _chunk_rows(options(chunking_method="square"), x, head)


@pytest.mark.parametrize("policy", ["accurate", "compact"])
def test_a_chunked_loss_of_bfloat16_weights_sums_their_gradient_as_asked(policy):
    """"compact" sums the chunks' weight gradients in bfloat16, "accurate" in float32: both
    within bfloat16's rounding of the float32 gradient, in the weight's dtype."""
    gen = torch.Generator().manual_seed(13)
    x, w = torch.randn(64, 32, generator=gen), torch.randn(300, 32, generator=gen) / 4
    t = torch.randint(0, 300, (64,), generator=gen)
    tx, tw = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.nn.functional.cross_entropy(tx @ tw.T, t).backward()
    gx, gw = (gtmpi.tensor(v, dtype=gtmpi.bfloat16, requires_grad=True) for v in (x, w))
    options = gtmpi.nn.LinearCrossEntropyOptions(batch_chunk_size=8, acc_policy=policy)
    gtmpi.nn.functional.linear_cross_entropy(gx, gw, gtmpi.tensor(t), options=options).backward()
    assert gw.grad.dtype == gtmpi.bfloat16
    torch.testing.assert_close(gw.grad.cpu_torch().float(), tw.grad, rtol=3e-2, atol=3e-4)
    torch.testing.assert_close(gx.grad.cpu_torch().float(), tx.grad, rtol=3e-2, atol=1e-4)
