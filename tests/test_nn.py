"""gtmpi.nn, gtmpi.optim and checkpoints against plain torch: layers, losses, a 50-step MLP
training run with SGD-momentum and AdamW, and checkpoints read by the other side."""
from __future__ import annotations

import gc
import math
import os
import pickle

import pytest
import torch

import gtmpi
import gtmpi.nn as gnn
import gtmpi.nn.functional as GF
from conftest import assert_same
from test_autograd import grad_check, r

TF = torch.nn.functional


def mlp_pair(seed: int = 0):
    torch.manual_seed(seed)
    t = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                            torch.nn.GELU(), torch.nn.Linear(64, 5))
    g = gnn.Sequential(gnn.Linear(20, 64), gnn.ReLU(), gnn.Linear(64, 64), gnn.GELU(), gnn.Linear(64, 5))
    g.load_state_dict(t.state_dict())
    return t, g


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "rmsprop", "adagrad"])
def test_mlp_training_matches_torch_for_50_steps(optimizer):
    t_model, g_model = mlp_pair()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(128, 20, generator=gen)
    y = torch.randint(0, 5, (128,), generator=gen)
    gx, gy = gtmpi.tensor(x), gtmpi.tensor(y)
    if optimizer == "sgd":
        t_opt = torch.optim.SGD(t_model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True)
        g_opt = gtmpi.optim.SGD(g_model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True)
    else:
        name, kw = {"adamw": ("AdamW", dict(lr=3e-3, weight_decay=0.05)),
                    "rmsprop": ("RMSprop", dict(lr=1e-3, momentum=0.9, weight_decay=1e-4)),
                    "adagrad": ("Adagrad", dict(lr=3e-2, lr_decay=1e-3))}[optimizer]
        t_opt = getattr(torch.optim, name)(t_model.parameters(), **kw)
        g_opt = getattr(gtmpi.optim, name)(g_model.parameters(), **kw)
    t_losses, g_losses = [], []
    for _ in range(50):
        t_opt.zero_grad()
        loss = TF.cross_entropy(t_model(x), y)
        loss.backward()
        t_opt.step()
        t_losses.append(loss.item())
        g_opt.zero_grad()
        g_loss = GF.cross_entropy(g_model(gx), gy)
        g_loss.backward()
        g_opt.step()
        g_losses.append(g_loss)
    g_losses = [l.item() for l in g_losses]   # one read per step, at the end
    for step, (a, b) in enumerate(zip(g_losses, t_losses)):
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)
    assert t_losses[-1] < 0.9 * t_losses[0]


def test_optimizer_steps_read_nothing():
    _, g_model = mlp_pair()
    opt = gtmpi.optim.Adam(g_model.parameters(), lr=1e-3, weight_decay=1e-3)
    x = gtmpi.randn(8, 20)
    before = {k: s["bytes_sent"] for k, s in gtmpi.debug.worker_stats().items()}
    for _ in range(3):
        opt.zero_grad()
        g_model(x).pow(2).mean().backward()
        gtmpi.optim.clip_grad_norm_(g_model.parameters(), 1.0)
        opt.step()
    after = gtmpi.debug.worker_stats()
    assert all(after[k]["bytes_sent"] == before[k] for k in after)
    assert all(p.requires_grad and p.is_leaf for p in g_model.parameters())


def test_layers_match_torch():
    torch.manual_seed(1)
    x = torch.randn(2, 5, 8)
    for t_layer, g_layer in [
        (torch.nn.LayerNorm(8), gnn.LayerNorm(8)),
        (torch.nn.RMSNorm(8), gnn.RMSNorm(8)),
        (torch.nn.Linear(8, 3, bias=False), gnn.Linear(8, 3, bias=False)),
    ]:
        with torch.no_grad():
            for p in t_layer.parameters():
                p.add_(torch.randn(p.shape) * 0.1)
        g_layer.load_state_dict(t_layer.state_dict())
        grad_check(lambda v, tl=t_layer, gl=g_layer: tl(v) if isinstance(v, torch.Tensor) else gl(v),
                   x, dtype=torch.float32, rtol=1e-4, atol=1e-5)
    assert_same(gnn.SiLU()(gtmpi.tensor(x)), TF.silu(x))
    assert_same(gnn.Softmax(1)(gtmpi.tensor(x)), torch.softmax(x, 1))
    assert_same(gnn.GELU("tanh")(gtmpi.tensor(x)), TF.gelu(x, approximate="tanh"))
    emb_t = torch.nn.Embedding(10, 4)
    emb_g = gnn.Embedding(10, 4)
    emb_g.load_state_dict(emb_t.state_dict())
    idx = torch.tensor([[1, 3, 3], [9, 0, 1]])
    assert_same(emb_g(gtmpi.tensor(idx)), emb_t(idx).detach())


def test_linear_default_init_is_torchs():
    layer = gnn.Linear(400, 300)
    w = layer.weight.detach().numpy()
    bound = 1 / math.sqrt(400)
    assert w.min() >= -bound and w.max() <= bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.05 * bound   # uniform's std


def test_attention_matches_torch():
    q, k, v = r(2, 3, 6, 4), r(2, 3, 6, 4), r(2, 3, 6, 4)
    grad_check(lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True)
               if isinstance(q, torch.Tensor) else GF.scaled_dot_product_attention(q, k, v, is_causal=True),
               q, k, v)
    torch.manual_seed(3)
    block = gnn.MultiheadSelfAttention(8, 2)
    x = torch.randn(2, 5, 8)
    sd = {k: v.cpu_torch() for k, v in block.state_dict().items()}
    qkv = x @ sd["qkv.weight"].T + sd["qkv.bias"]
    q, k, v = (t.reshape(2, 5, 2, 4).transpose(1, 2) for t in qkv.split(8, 2))
    want = TF.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 5, 8)
    want = want @ sd["proj.weight"].T + sd["proj.bias"]
    assert_same(block(gtmpi.tensor(x)), want, rtol=1e-4, atol=1e-5)


LOSSES = [
    ("mse", lambda a, t: TF.mse_loss(a, t), lambda a, t: GF.mse_loss(a, t), "float"),
    ("bce", lambda a, t: TF.binary_cross_entropy(a.sigmoid(), t), lambda a, t: GF.binary_cross_entropy(a.sigmoid(), t), "prob"),
    ("bce_logits", lambda a, t: TF.binary_cross_entropy_with_logits(a, t),
     lambda a, t: GF.binary_cross_entropy_with_logits(a, t), "prob"),
    ("cross_entropy", lambda a, t: TF.cross_entropy(a, t), lambda a, t: GF.cross_entropy(a, t), "class"),
    ("ce_ignore", lambda a, t: TF.cross_entropy(a, t, ignore_index=2),
     lambda a, t: GF.cross_entropy(a, t, ignore_index=2), "class"),
    ("ce_smooth", lambda a, t: TF.cross_entropy(a, t, label_smoothing=0.1),
     lambda a, t: GF.cross_entropy(a, t, label_smoothing=0.1), "class"),
    ("ce_sum", lambda a, t: TF.cross_entropy(a, t, reduction="sum"),
     lambda a, t: GF.cross_entropy(a, t, reduction="sum"), "class"),
    ("nll", lambda a, t: TF.nll_loss(a.log_softmax(-1), t), lambda a, t: GF.nll_loss(a.log_softmax(-1), t), "class"),
]


@pytest.mark.parametrize("name,t_fn,g_fn,kind", LOSSES, ids=[x[0] for x in LOSSES])
def test_losses_and_their_grads(name, t_fn, g_fn, kind):
    a = r(6, 4)
    target = {"float": r(6, 4), "prob": r(6, 4, low=0, high=1),
              "class": torch.tensor([0, 2, 3, 1, 2, 0])}[kind]
    grad_check(lambda x, t: t_fn(x, t) if isinstance(x, torch.Tensor) else g_fn(x, t), a, target)


def test_module_api():
    class Net(gnn.Module):
        def __init__(self):
            super().__init__()
            self.body = gnn.ModuleList([gnn.Linear(3, 3), gnn.Linear(3, 2)])
            self.heads = gnn.ModuleDict({"a": gnn.Linear(2, 1)})
            self.drop = gnn.Dropout(0.5)
            self.register_buffer("scale", gtmpi.ones(1))

        def forward(self, x):
            for layer in self.body:
                x = layer(x).relu()
            return self.heads["a"](self.drop(x)) * self.scale

    net = Net()
    names = [n for n, _ in net.named_parameters()]
    assert names == ["body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias",
                     "heads.a.weight", "heads.a.bias"]
    assert list(net.state_dict()) == ["scale"] + names  # torch's: module by module
    assert len(list(net.children())) == 3 and len(list(net.modules())) == 7
    assert net.training and not net.eval().drop.training
    out = net(gtmpi.randn(4, 3))
    out.sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    half = net.to(gtmpi.float16)
    assert all(p.dtype == torch.float16 and p.requires_grad for p in half.parameters())
    with pytest.raises(RuntimeError, match="Missing key"):
        net.load_state_dict({})
    from gtmpi.nn import SGD, Linear, Module  # GT's spellings
    assert issubclass(Linear, Module) and SGD is gtmpi.optim.SGD


def test_dropout_train_and_eval():
    x = gtmpi.ones(10000)
    y = GF.dropout(x, 0.3, training=True).numpy()
    assert abs((y == 0).mean() - 0.3) < 0.03 and abs(y[y > 0][0] - 1 / 0.7) < 1e-6
    assert GF.dropout(x, 0.3, training=False) is x


def test_dropout_gradient_applies_the_forwards_mask():
    x = gtmpi.randn(4000, requires_grad=True)
    y = GF.dropout(x, 0.25)
    assert y.grad_fn.name() == "NativeDropoutBackward0"  # torch's: one fused op, its mask saved
    y.sum().backward()
    xs, ys, gs = x.detach().numpy(), y.detach().numpy(), x.grad.numpy()
    kept = gs != 0
    assert 0.7 < kept.mean() < 0.8 and (ys[~kept] == 0).all()
    assert abs(gs[kept] - 1 / 0.75).max() < 1e-6
    assert abs(ys[kept] - xs[kept] / 0.75).max() < 1e-5


def test_dropout_in_place_drops_in_the_tensor_itself_and_its_gradient_too():
    """nn.Dropout(inplace=True) and F.dropout(inplace=True), as torch's: the input becomes the
    result (the same masks as out of place, from the same seed), and the gradient flows
    through the mask to what made it."""
    w = gtmpi.randn(4000, requires_grad=True)
    gtmpi.manual_seed(7)
    want = GF.dropout(w * 2, 0.25)
    gtmpi.manual_seed(7)
    h = w * 2
    y = gtmpi.nn.Dropout(0.25, inplace=True)(h)
    assert y is h and torch.equal(h.detach().cpu_torch(), want.detach().cpu_torch())
    y.sum().backward()
    kept = want.detach().cpu_torch() != 0
    assert 0.7 < kept.float().mean() < 0.8
    assert torch.allclose(w.grad.cpu_torch()[kept], torch.full((int(kept.sum()),), 2 / 0.75))
    assert (w.grad.cpu_torch()[~kept] == 0).all()
    x = gtmpi.ones(10)
    assert GF.dropout(x, 0.5, training=False, inplace=True) is x
    assert GF.dropout(x, 1.0, inplace=True) is x and x.sum().item() == 0


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_torch(norm_type):
    t_model, g_model = mlp_pair(3)
    x = torch.randn(16, 20)
    t_model(x).pow(2).sum().backward()
    g_model(gtmpi.tensor(x)).pow(2).sum().backward()
    t_norm = torch.nn.utils.clip_grad_norm_(t_model.parameters(), 0.5, norm_type)
    home = min(gtmpi.info()["workers"])

    def ops() -> int:
        stats = gtmpi.debug.worker_stats()[home]
        return stats["ops"] - stats["control"]
    before = ops()
    g_norm = gtmpi.optim.clip_grad_norm_(g_model.parameters(), 0.5, norm_type)
    # whatever the number of gradients: one norm of them all (a sum of p-th powers, then its
    # root), the scale's three scalar ops (+ eps, max_norm / it, clamp), one scaling of them all
    assert ops() - before == (5 if norm_type == float("inf") else 6)
    assert math.isclose(g_norm.item(), t_norm.item(), rel_tol=1e-4)
    for (_, gp), tp in zip(g_model.named_parameters(), t_model.parameters()):
        assert_same(gp.grad, tp.grad, rtol=1e-4, atol=1e-6)


def test_cosine_schedule_with_warmup():
    p = gnn.Parameter(gtmpi.zeros(1))
    opt = gtmpi.optim.SGD([p], lr=1.0)
    sched = gtmpi.optim.lr_scheduler.CosineWithWarmup(opt, warmup_steps=4, total_steps=14)
    lrs = []
    for _ in range(16):
        lrs.append(sched.get_last_lr()[0])
        sched.step()
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert math.isclose(lrs[9], 0.5, abs_tol=1e-9) and lrs[14] == lrs[15] == 0.0


def test_checkpoints_round_trip_with_plain_torch(tmp_path):
    t_model, g_model = mlp_pair(7)
    with torch.no_grad():
        for p in t_model.parameters():
            p.mul_(1.5)
    torch.save(t_model.state_dict(), tmp_path / "torch.pt")
    g_model.load_state_dict(gtmpi.load(tmp_path / "torch.pt"))
    x = torch.randn(3, 20)
    assert_same(g_model(gtmpi.tensor(x)), t_model(x).detach(), rtol=1e-5, atol=1e-6)
    with gtmpi.no_grad():
        for p in g_model.parameters():
            p *= -1.0
    gtmpi.save({"model": g_model.state_dict(), "step": 12}, tmp_path / "gtmpi.pt")
    blob = torch.load(tmp_path / "gtmpi.pt")
    assert blob["step"] == 12
    fresh, _ = mlp_pair(8)
    fresh.load_state_dict(blob["model"])
    assert_same(g_model(gtmpi.tensor(x)), fresh(x).detach(), rtol=1e-5, atol=1e-6)


def _flip_a_bit_of(path, record: str) -> None:
    """One bit of ``record``'s bytes in a torch zip checkpoint, flipped in place."""
    import struct
    import zipfile
    with zipfile.ZipFile(path) as z:
        offset = z.getinfo(next(n for n in z.namelist() if n.endswith(record))).header_offset
    blob = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", blob[offset + 26:offset + 30])
    blob[offset + 30 + name_len + extra_len + 5] ^= 0x10
    path.write_bytes(bytes(blob))


def test_a_flipped_bit_in_a_checkpoint_is_refused_by_name(tmp_path):
    """torch.load reads the changed weight silently; gtmpi.load checks every record's CRC-32."""
    path = tmp_path / "ck.pt"
    gtmpi.save({"w": gtmpi.arange(1000.0), "step": 3}, path)
    assert gtmpi.load(path)["step"] == 3
    _flip_a_bit_of(path, "data/0")
    assert not torch.equal(torch.load(path)["w"], torch.arange(1000.0))  # torch: no error
    with pytest.raises(RuntimeError, match=r"ck.pt is damaged.*data/0"):
        gtmpi.load(path)
    path.write_bytes(path.read_bytes()[:-40])  # a partial copy: the archive's end is gone
    with pytest.raises(RuntimeError, match="is damaged"):
        gtmpi.load(path)


def test_save_replaces_the_file_whole_with_torchs_mode_and_writes_to_file_objects(tmp_path):
    import io
    path = tmp_path / "ck.pt"
    gtmpi.save({"step": 1}, path)
    mask = os.umask(0)
    os.umask(mask)
    assert (os.stat(path).st_mode & 0o777) == 0o666 & ~mask
    os.chmod(path, 0o600)
    gtmpi.save({"step": 2, "w": gtmpi.ones(4)}, str(path))
    assert (os.stat(path).st_mode & 0o777) == 0o600  # the replaced file's mode is kept
    assert os.listdir(tmp_path) == ["ck.pt"]  # no temporary file left
    assert torch.load(path)["step"] == 2
    buf = io.BytesIO()
    gtmpi.save({"w": gtmpi.ones(2)}, buf)
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()))["w"], torch.ones(2))
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):  # what cannot be pickled fails the save, not the old file
        gtmpi.save({"f": lambda: 0}, path)
    assert torch.load(path)["step"] == 2 and os.listdir(tmp_path) == ["ck.pt"]


def test_saving_into_a_missing_folder_is_torchs_error_naming_the_users_path(tmp_path):
    """Not a FileNotFoundError naming the temporary file the save would have written."""
    path = tmp_path / "missing" / "ck.pt"
    with pytest.raises(RuntimeError) as want:
        torch.save({"step": 1}, path)
    with pytest.raises(RuntimeError) as got:
        gtmpi.save({"w": gtmpi.ones(2)}, path)
    assert str(got.value) == str(want.value) == f"Parent directory {tmp_path / 'missing'} " \
        "does not exist."
    with pytest.raises(RuntimeError, match="Parent directory missing does not exist"):
        gtmpi.save({"step": 1}, "missing/ck.pt")  # relative: named as given, as torch does


def test_linear_and_cross_entropy_are_single_instructions_with_torch_grads():
    """Fused forward and backward (fewer instructions per step) with torch's exact semantics."""
    x, w, b = r(6, 4), r(3, 4), r(3)
    grad_check(lambda x, w, b: TF.linear(x, w, b) if isinstance(x, torch.Tensor) else GF.linear(x, w, b), x, w, b)
    grad_check(lambda x, w: TF.linear(x, w) if isinstance(x, torch.Tensor) else GF.linear(x, w), r(2, 5, 4), w)
    grad_check(lambda x, w: TF.linear(x, w) if isinstance(x, torch.Tensor) else GF.linear(x, w), r(4), w)
    # earlier tests' garbage (a captured model's cycle, say) freed inside the window would
    # count too: collected first, and no collection inside
    gc.collect()
    gc.disable()
    try:
        before = gtmpi.debug.worker_stats()[min(gtmpi.info()["workers"])]["ops"]
        logits = gtmpi.randn(5, 7, requires_grad=True)
        GF.cross_entropy(logits, gtmpi.tensor([0, 6, 2, 2, 1]), label_smoothing=0.1).backward()
        after = gtmpi.debug.worker_stats()[min(gtmpi.info()["workers"])]["ops"]
    finally:
        gc.enable()
    assert after - before <= 8   # randn, upload, forward, ones_like, grad, accumulate, stats


def test_module_to_dtype_keeps_its_parameters_and_converts_their_gradients():
    """As torch: the same Parameter objects (an optimizer made before still holds them), their
    gradients converted too."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 2)
    m = gtmpi.nn.Linear(3, 2)
    m.load_state_dict(ref.state_dict())
    topt = torch.optim.SGD(ref.parameters(), lr=0.5)
    gopt = gtmpi.optim.SGD(m.parameters(), lr=0.5)
    x = torch.randn(4, 3)
    ref(x).sum().backward()
    m(gtmpi.tensor(x)).sum().backward()
    before = m.weight
    ref.double()
    m.double()
    assert m.weight is before and m.weight.dtype == torch.float64
    assert m.weight.grad.dtype == ref.weight.grad.dtype == torch.float64
    topt.step()
    gopt.step()
    torch.testing.assert_close(m.weight.cpu_torch(), ref.weight.detach())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_layers_take_torchs_device_and_dtype_keywords(dtype):
    """nn.Linear(4, 3, device="cuda", dtype=...) as torch writes it: the parameters made and
    drawn in that dtype (torch's numbers under the same seed), on the workers at once."""
    made = {}
    for lib in (torch, gtmpi):
        torch.manual_seed(0)
        made[lib] = [lib.nn.Linear(4, 3, device="cpu" if lib is torch else "cuda", dtype=dtype),
                     lib.nn.Embedding(5, 2, dtype=dtype), lib.nn.LayerNorm(3, dtype=dtype),
                     lib.nn.Conv1d(2, 2, 3, dtype=dtype), lib.nn.BatchNorm1d(2, dtype=dtype),
                     lib.nn.ConvTranspose2d(2, 3, 2, dtype=dtype),
                     lib.nn.GroupNorm(1, 2, dtype=dtype), lib.nn.PReLU(dtype=dtype)]
    for t, g in zip(made[torch], made[gtmpi]):
        for (name, tp), gp in zip(t.state_dict().items(), g.state_dict().values()):
            assert gp.dtype == tp.dtype, name
            assert torch.equal(gp.cpu_torch(), tp), name
    assert made[gtmpi][0].weight._host is None  # a GPU device: on the workers now
    assert torch.get_default_dtype() == torch.float32
