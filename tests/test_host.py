"""Tensors the client holds (client/host.py): made without a device, as torch makes them on the
CPU. torch.manual_seed gives torch's own numbers (draws from torch's CPU generator), reads of
them wait for nothing, small ops on them run in the client, and the first op that needs one on
a worker places it: one upload, or its recipe run there."""
from __future__ import annotations


import numpy as np
import pytest
import torch

import gtmpi
from gtmpi.recording import fileformat
from gtmpi.trace import analysis
from test_torch_port import load

WORKERS = sorted(gtmpi.info()["workers"])


@pytest.fixture(autouse=True)
def held(monkeypatch):
    monkeypatch.setenv("GTMPI_HOST_TENSORS", "1")


def _reads(path: str) -> int:
    """Rank 0's waits for a read in a trace."""
    rows = analysis.wait_rows(fileformat.read(path))
    return sum(r["count"] for r in rows if r["wait"] == "read")


def test_draws_without_a_device_are_torchs():
    torch.manual_seed(7)
    want = (torch.randn(3, 4), torch.randint(0, 100, (5,)), torch.rand(2), torch.randperm(6))
    gtmpi.manual_seed(7)
    got = (gtmpi.randn(3, 4), gtmpi.randint(0, 100, (5,)), gtmpi.rand(2), gtmpi.randperm(6))
    for g, w in zip(got, want):
        assert torch.equal(g.cpu_torch(), w)
    gen = gtmpi.Generator().manual_seed(3)
    assert isinstance(gen, torch.Generator)
    assert torch.equal(gtmpi.randn(4, generator=gen).cpu_torch(),
                       torch.randn(4, generator=torch.Generator().manual_seed(3)))
    # on a GPU's generator: the workers' draws, repeatable by its seed
    cuda = gtmpi.Generator(device="cuda")
    a = gtmpi.randn(4, device="cuda", generator=cuda.manual_seed(5)).tolist()
    b = gtmpi.randn(4, device="cuda", generator=cuda.manual_seed(5)).tolist()
    assert a == b


def test_random_states_saved_and_loaded_with_gtmpi_set_the_same_draws_again(tmp_path):
    """A checkpoint's random states (the host's generator, a torch.Generator, the workers'
    stream) come back from gtmpi.load as gtmpi tensors: each set_state takes them."""
    gtmpi.manual_seed(3)
    gen = gtmpi.Generator()
    gen.manual_seed(4)
    gtmpi.save({"cpu": gtmpi.get_rng_state(), "cuda": gtmpi.cuda.get_rng_state(),
                "gen": gen.get_state()}, tmp_path / "rng.pt")
    want = (torch.randn(3), gtmpi.randn(3, device="cuda").cpu_torch(),
            torch.randn(3, generator=gen))
    states = gtmpi.load(tmp_path / "rng.pt")
    gtmpi.set_rng_state(states["cpu"])
    gtmpi.cuda.set_rng_state(states["cuda"])
    gen.set_state(states["gen"])
    got = (torch.randn(3), gtmpi.randn(3, device="cuda").cpu_torch(),
           torch.randn(3, generator=gen))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="2 numbers"):
        gtmpi.cuda.set_rng_state(torch.zeros(5, dtype=torch.int64))


def test_torch_seed_gives_torchs_initial_weights_and_loss():
    """A nanoGPT-style GPT (tests/gpt_torch_style.py, imports switched) built under one seed
    has torch's weights, and its first loss on torch's first batch is torch's, bit for bit."""
    T, G = load("gpt_torch_style_torch", False), load("gpt_torch_style_gtmpi", True)
    losses = []
    for lib, mod in ((torch, T), (gtmpi, G)):
        lib.manual_seed(1337)
        model = mod.GPT(mod.GPTConfig())
        ix = lib.randint(0, 60, (4, 9))
        _, loss = model(ix[:, :-1].contiguous(), ix[:, 1:].contiguous())
        losses.append((model, float(loss)))
    (t_model, t_loss), (g_model, g_loss) = losses
    for (name, p), q in zip(g_model.named_parameters(), t_model.parameters()):
        assert torch.equal(p.cpu_torch(), q.detach()), name
    assert g_loss == t_loss


def test_reads_of_held_values_wait_for_nothing(tmp_path):
    """nanoGPT's get_batch: indices from torch.randint iterated, host arrays sliced with them,
    rows stacked, pinned and moved: no read, and each batch one upload, made by the worker only
    where an op needs it."""
    data = np.arange(10_000, dtype=np.uint16)
    path = str(tmp_path / "batch.h5")
    gtmpi.synchronize()
    gtmpi.trace.start(path)
    for _ in range(3):
        ix = gtmpi.randint(len(data) - 16, (4,))
        x = gtmpi.stack([gtmpi.from_numpy(data[i:i + 16].astype(np.int64)) for i in ix])
        assert x.device.type == "cpu" and x._host is not None  # held: nothing sent yet
        x = x.pin_memory().to("cuda", non_blocking=True)
        assert x._host is None  # handed to the workers
        assert [int(i) for i in ix] == ix.tolist()
        y = (x * 2).sum()
    total = int(y)
    gtmpi.trace.stop()
    assert _reads(path) == 1  # int(y): the only value that came back
    assert total == 2 * int(x.cpu_torch().sum())
    kinds, _ = analysis.transfer_rows(fileformat.read(path))
    uploads = next(r for r in kinds if r["kind"] == "upload")
    assert uploads["count"] == 3 and uploads["bytes"] == 3 * 4 * 16 * 8


def test_iterating_a_worker_tensor_reads_it_once(tmp_path):
    idx = gtmpi.randint(0, 50, (6,), device="cuda")  # drawn by a worker
    path = str(tmp_path / "iter.h5")
    gtmpi.synchronize()
    gtmpi.trace.start(path)
    picked = [int(i) for i in idx]
    again = idx.tolist()
    gtmpi.trace.stop()
    assert picked == again
    assert _reads(path) == 2  # one for the whole loop, one for tolist()


def test_small_ops_on_held_values_run_here_and_big_ones_on_a_worker():
    a = gtmpi.tensor([[1.0, 2.0], [3.0, 4.0]])
    b = (a * 2 + 1).T
    assert b._host is not None and b.tolist() == [[3.0, 7.0], [5.0, 9.0]]
    assert not b.is_contiguous()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        b.view(4)  # torch's own error, from torch's CPU kernel
    losses = gtmpi.zeros(3)
    for k in range(3):
        losses[k] = float(k)  # in place, held
    assert losses._host is not None and float(losses.mean()) == 1.0
    big = gtmpi.ones(512, 512)  # its recipe: no bytes are uploaded for it
    s = (big @ big).sum()
    assert big._host is None and float(s) == 512.0 ** 3


def test_parameters_made_without_a_device_are_placed_at_first_use_or_by_to():
    m = gtmpi.nn.Linear(4, 3)
    assert m.weight._host is not None
    m.to("cuda")
    assert m.weight._host is None and m.bias._host is None
    n = gtmpi.nn.Linear(4, 3)
    out = n(gtmpi.randn(2, 4))
    assert n.weight._host is None and out.shape == (2, 3)


def test_a_held_value_nothing_else_reaches_is_sent_without_a_copy(monkeypatch):
    """A parameter's held weights go to the worker as they are (a copy of GPT-3 6.7B's float32
    weights cost rank 0 minutes of page faults); a value a view made here shares is copied, so
    an in-place op on the other after the upload leaves what was sent as it was."""
    from gtmpi.client import tensor as client_tensor
    sent = []
    real = client_tensor.upload
    monkeypatch.setattr(client_tensor, "upload", lambda value, copy=True: (
        sent.append((value.data_ptr(), copy)), real(value, copy))[1])
    m = gtmpi.nn.Linear(64, 32)
    held = m.weight._host.data_ptr()
    m.to("cuda")
    assert sent[0] == (held, False)
    w = gtmpi.tensor([[0.0] * 4] * 4)  # a value made here, no recipe: uploaded
    row = w[1]  # a view of w's storage
    assert w._host is not None and row._host is not None and row._shared and w._shared
    placed = row + gtmpi.zeros(4, device="cuda")  # the view is uploaded, copied
    assert sent[-1][1] is True
    w.fill_(5.0)  # in place on the value the view shares, still held here
    assert placed.tolist() == [0.0] * 4 and w.tolist() == [[5.0] * 4] * 4
    alone = gtmpi.tensor([1.0, 2.0, 3.0]) * 2  # no recipe: uploaded
    assert not alone._shared
    (alone + gtmpi.zeros(3, device="cuda")).tolist()
    assert sent[-1][1] is False


def test_cuda_queries_answered_by_the_workers():
    gpu = gtmpi.cuda.is_available()
    assert gpu == any(str(w["device"]).startswith("cuda") for w in gtmpi.info()["workers"].values())
    assert gtmpi.cuda.is_bf16_supported() == gpu
    if gpu:
        assert gtmpi.cuda.get_device_name() == torch.cuda.get_device_name(0)
    else:
        with pytest.raises(RuntimeError, match="no GPU"):
            gtmpi.cuda.get_device_properties()
    start, end = gtmpi.cuda.Event(enable_timing=True), gtmpi.cuda.Event(enable_timing=True)
    start.record()
    x = gtmpi.randn(256, 256, device="cuda")
    for _ in range(20):
        x = x @ x / 256
    end.record()
    gtmpi.cuda.synchronize()
    assert start.elapsed_time(end) > 0
    with pytest.raises(RuntimeError, match="enable_timing"):
        gtmpi.cuda.Event().elapsed_time(end)
    gtmpi.cuda.reset_peak_memory_stats()
    assert gtmpi.cuda.max_memory_allocated() >= 0 and gtmpi.cuda.memory_allocated() >= 0
    assert "worker rank" in gtmpi.cuda.memory_summary()
    gtmpi.cuda.empty_cache()
    gtmpi.cuda.set_device(0)
    assert gtmpi.cuda.current_device() == 0


def test_an_upload_larger_than_a_piece_travels_in_pieces_and_arrives_whole(monkeypatch):
    """An upload of more than UPLOAD_PIECE_BYTES goes as one message a piece, which a GPU
    worker receives into a pinned buffer it reuses, copying each to the GPU while the next
    arrives; the value arrives whole, its bytes in order. A smaller one goes as one message."""
    from gtmpi.client.runtime import runtime
    from gtmpi.transport.buffers import UPLOAD_PIECE_BYTES
    d = runtime().dispatcher
    sent = []
    link = d.links[d.home]
    real = link.upload
    monkeypatch.setattr(link, "upload", lambda data: (sent.append(data.nbytes), real(data))[1])
    n = UPLOAD_PIECE_BYTES // 4 * 2 + 1000  # two pieces and 4,000 bytes
    value = torch.arange(n, dtype=torch.int32)
    big = gtmpi.tensor(value, device="cuda")
    assert sent == [UPLOAD_PIECE_BYTES, UPLOAD_PIECE_BYTES, 4000]
    small = gtmpi.tensor(value[:1000], device="cuda")
    assert sent[3:] == [4000]
    assert torch.equal(big.cpu_torch(), value) and torch.equal(small.cpu_torch(), value[:1000])
    assert torch.equal((big[n - 1000:] - small).cpu_torch(), torch.full((1000,), n - 1000,
                                                                        dtype=torch.int32))
