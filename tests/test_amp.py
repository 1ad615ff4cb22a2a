"""What a training script of the kind the field copies reaches for besides the model: autocast
and GradScaler (gtmpi/amp.py), torch.backends' settings (they reach the workers), the data
loader, torch.load's arguments, compile, and what a missing name says."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import gtmpi
from conftest import HOME_DEVICE
from gtmpi.client.runtime import runtime

DEVICE_TYPE = HOME_DEVICE.type


def _mlp(lib, gen):
    """A small model with what autocast treats three ways: linears (cast down), layer_norm
    (float32 on GPUs, as given on CPUs), GELU (as given) and cross-entropy (float32)."""
    torch.manual_seed(gen)
    w1, b1 = torch.randn(32, 16) / 4, torch.randn(32) / 4
    w2 = torch.randn(10, 32) / 4
    g, b = torch.ones(32), torch.zeros(32)
    return [(t.to(HOME_DEVICE).clone() if lib is torch else gtmpi.tensor(t)).requires_grad_()
            for t in (w1, b1, w2, g, b)]


def _loss(lib, params, x, y, dtype):
    F = lib.nn.functional
    w1, b1, w2, g, b = params
    with lib.autocast(device_type=DEVICE_TYPE, dtype=dtype):
        h = F.gelu(F.layer_norm(F.linear(x, w1, b1), (32,), g, b))
        logits = F.linear(h, w2)
        loss = F.cross_entropy(logits, y)
    return logits, loss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_gives_torchs_dtypes_losses_and_gradients(dtype):
    if dtype == torch.float16 and DEVICE_TYPE == "cpu":
        pytest.skip("torch's CPU autocast of float16 matmuls is slow and rare")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    t_params, g_params = _mlp(torch, 0), _mlp(gtmpi, 0)
    t_logits, t_loss = _loss(torch, t_params, x.to(HOME_DEVICE), y.to(HOME_DEVICE), dtype)
    g_logits, g_loss = _loss(gtmpi, g_params, gtmpi.tensor(x), gtmpi.tensor(y), dtype)
    assert g_logits.dtype == t_logits.dtype == dtype and g_loss.dtype == t_loss.dtype
    t_loss.backward()
    g_loss.backward()
    # bit for bit on CPUs; on an H100 (2026-11-27, before cross_entropy took torch's CUDA
    # composite) the loss came out 2.813183 against torch's 2.813965 (bf16)
    tol = {"rtol": 0, "atol": 0} if DEVICE_TYPE == "cpu" else {"rtol": 2e-3, "atol": 2e-3}
    torch.testing.assert_close(g_loss.cpu_torch(), t_loss.detach().cpu(), **tol)
    for p, q in zip(g_params, t_params):
        assert p.grad.dtype == q.grad.dtype == torch.float32  # back to the leaf's dtype
        torch.testing.assert_close(p.grad.cpu_torch(), q.grad.cpu(), **tol)
    # a region turned off inside, and a decorated function
    with gtmpi.autocast(DEVICE_TYPE, dtype=dtype):
        with gtmpi.autocast(DEVICE_TYPE, enabled=False):
            assert (gtmpi.ones(2, 2) @ gtmpi.ones(2, 2)).dtype == torch.float32
    assert gtmpi.autocast(DEVICE_TYPE, dtype=dtype)(lambda: gtmpi.ones(2, 2) @ gtmpi.ones(2, 2))(
    ).dtype == dtype
    with pytest.raises(RuntimeError, match="unsupported autocast device_type 'xla'"):
        gtmpi.autocast("xla")


def test_cuda_autocast_cross_entropy_is_torchs_composite():
    """torch's CUDA autocast has no rule for cross_entropy: its composite takes log_softmax in
    the logits' dtype (an explicit dtype, which autocast keeps) and nll_loss in float32. gtmpi
    does the same under autocast('cuda'), whatever device its workers have; compared here with
    that composite written out in torch."""
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(5)).bfloat16()
    y = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(6))
    t_logits = logits.clone().requires_grad_()
    want = torch.nn.functional.nll_loss(torch.log_softmax(t_logits, 1).float(), y)
    want.backward()
    g_logits = gtmpi.tensor(logits).requires_grad_()
    with gtmpi.autocast("cuda", dtype=torch.bfloat16):
        got = gtmpi.nn.functional.cross_entropy(g_logits, gtmpi.tensor(y))
    got.backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu_torch(), want.detach(), rtol=0, atol=0)
    assert g_logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(g_logits.grad.cpu_torch(), t_logits.grad, rtol=0, atol=0)


@pytest.mark.parametrize("capture", ["0", "1"])
def test_grad_scaler_scales_unscales_skips_and_backs_off_as_torch(monkeypatch, capture):
    """An enabled scaler (float32 here: the arithmetic is the scaler's): the scaled backward,
    unscale_ before clipping, a step skipped on an infinite gradient with the scale halved,
    and growth after growth_interval good steps. Captured (GTMPI_CAPTURE=1), the unscale, the
    clip and the step replay from their third call, each unscale given the scale of its step."""
    monkeypatch.setenv("GTMPI_CAPTURE", capture)
    runtime().capture_notes.clear()
    runtime().repeated.clear()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(4))
    runs = {}
    for lib in (torch, gtmpi):
        params = _mlp(lib, 5)
        opt = lib.optim.SGD(params, lr=0.1)
        scaler = (torch.amp.GradScaler(DEVICE_TYPE, init_scale=2.0 ** 10, growth_interval=2)
                  if lib is torch else
                  gtmpi.amp.GradScaler(DEVICE_TYPE, init_scale=2.0 ** 10, growth_interval=2))
        xs, ys = (x.to(HOME_DEVICE), y.to(HOME_DEVICE)) if lib is torch else \
            (gtmpi.tensor(x), gtmpi.tensor(y))
        scales = []
        for step in range(8):
            loss = lib.nn.functional.cross_entropy(lib.nn.functional.linear(
                lib.nn.functional.linear(xs, params[0], params[1]), params[2]), ys)
            if step == 2:
                loss = loss * float("inf")  # an overflow: this step is skipped
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            lib.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(float(scaler.get_scale()))
        runs[lib.__name__] = (scales, [p.detach().cpu() if lib is torch else p.cpu_torch()
                                       for p in params])
    assert runs["gtmpi"][0] == runs["torch"][0] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0,
                                                    2048.0, 4096.0, 4096.0]
    for p, q in zip(runs["gtmpi"][1], runs["torch"][1]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    replayed = {name.split(" (")[0]: notes["replayed"]
                for name, notes in runtime().capture_notes.items() if notes["replayed"]}
    # 8 calls: a warm-up, a recording, 6 replays; the overflow's step is skipped: 5
    assert replayed == ({} if capture == "0" else
                        {"GradScaler.unscale_": 6, "clip_grad_norm_": 6, "SGD.step": 5})
    off = gtmpi.cuda.amp.GradScaler(enabled=False)
    loss = gtmpi.ones(1, requires_grad=True).sum()
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and not off.is_enabled()


def test_backend_settings_reach_every_worker():
    before = gtmpi.get_float32_matmul_precision()
    try:
        gtmpi.backends.cuda.matmul.allow_tf32 = True
        gtmpi.backends.cudnn.allow_tf32 = False
        gtmpi.set_float32_matmul_precision("medium")
        for rank, stats in gtmpi.debug.worker_stats().items():
            assert stats["settings"]["float32_matmul_precision"] == "medium", rank
            assert stats["settings"]["cudnn.allow_tf32"] is False, rank
        assert gtmpi.get_float32_matmul_precision() == "medium"
        with pytest.raises(AttributeError, match="not a setting gtmpi passes on"):
            gtmpi.backends.cudnn.enabled = False
        with pytest.raises(RuntimeError, match="Invalid precision"):
            gtmpi.set_float32_matmul_precision("low")
    finally:
        gtmpi.set_float32_matmul_precision(before)
        gtmpi.backends.cudnn.allow_tf32 = True


def test_data_loader_gives_torchs_batches():
    xs, ys = torch.randn(10, 3), torch.arange(10)
    for kw in ({"batch_size": 4}, {"batch_size": 4, "shuffle": True, "drop_last": True},
               {"batch_size": 3, "shuffle": True}):
        t_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys),
                                               generator=torch.Generator().manual_seed(7), **kw)
        g_loader = gtmpi.utils.data.DataLoader(gtmpi.utils.data.TensorDataset(xs, ys),
                                               generator=torch.Generator().manual_seed(7), **kw)
        assert len(g_loader) == len(t_loader)
        for (gx, gy), (tx, ty) in zip(g_loader, t_loader, strict=True):
            assert torch.equal(gx.cpu_torch(), tx) and torch.equal(gy.cpu_torch(), ty)
    orders = []  # no generator given: gtmpi.manual_seed seeds the sampler's, as torch's does
    for seed_with, loader in ((gtmpi, gtmpi.utils.data.DataLoader), (gtmpi, gtmpi.utils.data.
                              DataLoader), (torch, torch.utils.data.DataLoader)):
        seed_with.manual_seed(11)
        orders.append([y.tolist() for _, y in loader(
            gtmpi.utils.data.TensorDataset(xs, ys) if seed_with is gtmpi else
            torch.utils.data.TensorDataset(xs, ys), batch_size=4, shuffle=True)])
    assert orders[0] == orders[1] == orders[2] and sum(orders[2], []) != list(range(10))
    pairs = [(gtmpi.tensor([float(i)]), i) for i in range(5)]  # any dataset: stacked, collated
    batches = list(gtmpi.utils.data.DataLoader(pairs, batch_size=2))
    assert [b[0].tolist() for b in batches] == [[[0.0], [1.0]], [[2.0], [3.0]], [[4.0]]]
    assert [b[1].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="Size mismatch"):
        gtmpi.utils.data.TensorDataset(torch.ones(3), torch.ones(4))


def test_splits_subsets_and_samplers_give_torchs_batches():
    """random_split (the host's generator, seeded by gtmpi.manual_seed as torch's), Subset,
    ConcatDataset and a weighted sampler over a TensorDataset: torch's batches, a split's
    rows taken from the dataset at once."""
    xs, ys = torch.randn(12, 3), torch.arange(12)
    got = {}
    for lib in (torch, gtmpi):
        data = lib.utils.data
        lib.manual_seed(5)
        train, val = data.random_split(data.TensorDataset(xs, ys), [8, 4])
        loaders = [data.DataLoader(train, batch_size=3, shuffle=True,
                                   generator=torch.Generator().manual_seed(2)),
                   data.DataLoader(data.Subset(val, [3, 1]), batch_size=2),
                   data.DataLoader(data.ConcatDataset([val, val]), batch_size=5),
                   data.DataLoader(train, batch_size=4, sampler=data.WeightedRandomSampler(
                       [0.1] * 4 + [1.0] * 4, 8, generator=torch.Generator().manual_seed(3)))]
        got[lib] = [[(x.tolist(), y.tolist()) for x, y in loader] for loader in loaders]
    assert got[gtmpi] == got[torch]


def test_load_takes_torchs_arguments(tmp_path):
    path = tmp_path / "ck.pt"
    gtmpi.save({"w": gtmpi.arange(4), "step": 3}, path)
    for kw in ({"map_location": "cpu"}, {"map_location": "cuda", "weights_only": True},
               {"weights_only": False, "mmap": True}):
        got = gtmpi.load(path, **kw)
        assert got["w"].tolist() == [0, 1, 2, 3] and got["step"] == 3


Pair = collections.namedtuple("Pair", "a b")  # a named tuple pickle finds by its name


def test_a_checkpoints_containers_come_back_as_they_were_saved(tmp_path):
    """A Counter (MultiStepLR's milestones), a defaultdict and a named tuple holding tensors,
    through gtmpi.save and gtmpi.load, and a file of torch's through gtmpi.load: each comes back
    of its own type with its own items (a Counter came back counting its (key, count) pairs)."""
    made = collections.defaultdict(list, {"x": [1]})

    def state(lib):
        return {"milestones": collections.Counter([2, 5, 5, 9]), "made": made,
                "pair": Pair(lib.arange(3), 4)}
    gtmpi.save(state(gtmpi), tmp_path / "g.pt")
    torch.save(state(torch), tmp_path / "t.pt")
    for name in ("g.pt", "t.pt"):
        got = gtmpi.load(tmp_path / name, weights_only=False)
        assert got["milestones"] == collections.Counter({5: 2, 2: 1, 9: 1})
        assert type(got["made"]) is collections.defaultdict and got["made"]["x"] == [1]
        assert got["made"]["new"] == [] and got["made"].default_factory is list
        assert type(got["pair"]) is Pair and got["pair"].a.tolist() == [0, 1, 2]
        assert got["pair"].b == 4


def test_compile_replays_a_step_and_says_what_it_does_with_a_module():
    w = gtmpi.ones(3, requires_grad=True)

    @gtmpi.compile(mode="max-autotune")
    def step(x):
        loss = (x * w).sum()
        loss.backward()
        return loss

    assert [step(gtmpi.full((3,), float(i))).item() for i in range(4)] == [0.0, 3.0, 6.0, 9.0]
    assert step.replays == 2
    assert step.compile == "auto"  # its program compiled where that wins (test_compile.py)


def test_a_missing_name_says_what_to_use():
    with pytest.raises(AttributeError, match="no attribute 'as_tensor': use gtmpi.tensor"):
        gtmpi.as_tensor  # noqa: B018
    with pytest.raises(AttributeError, match="torch.fft has no gtmpi counterpart yet"):
        gtmpi.fft  # noqa: B018
    with pytest.raises(AttributeError, match="did you mean tensor"):
        gtmpi.tensr  # noqa: B018


def test_memmap_batches_indexed_by_tensor_elements():
    """nanoGPT's get_batch: offsets from randint, rows sliced out of a memmap by each element."""
    data = np.arange(100, dtype=np.uint16)
    ix = gtmpi.randint(len(data) - 8, (4,))
    x = gtmpi.stack([gtmpi.from_numpy((data[i:i + 8]).astype(np.int64)) for i in ix])
    y = gtmpi.stack([gtmpi.from_numpy((data[i + 1:i + 1 + 8]).astype(np.int64)) for i in ix])
    starts = ix.tolist()
    assert x.tolist() == [list(range(s, s + 8)) for s in starts]
    assert y.tolist() == [list(range(s + 1, s + 9)) for s in starts]
