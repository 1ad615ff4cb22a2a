"""Sharding by signals: the same two-layer model trained three ways, each equal to one worker.

    mpiexec -n 3 python examples/signals_demo.py      # 2 workers: DP, TP, pipeline
    mpiexec -n 5 python examples/signals_demo.py      # 4 workers: DP × TP as well

The model code never changes; signals name where tensors go, and a YAML config (configs/)
says what each name means. The dispatcher inserts the collectives the placements need.
"""
import contextlib
import os

import numpy as np
import torch

import gtmpi
import gtmpi.nn.functional as F

if len(gtmpi.info()["workers"]) < 2:
    raise SystemExit("run with at least 2 workers: mpiexec -n 3 python examples/signals_demo.py")
HERE = os.path.dirname(os.path.abspath(__file__))
gen = torch.Generator().manual_seed(0)
INIT = [torch.randn(32, 8, generator=gen) * 0.3, torch.randn(32, generator=gen) * 0.1,
        torch.randn(4, 32, generator=gen) * 0.3, torch.randn(4, generator=gen) * 0.1]
X, Y = torch.randn(64, 8, generator=gen), torch.randint(0, 4, (64,), generator=gen)


def signal(name):
    return gtmpi.signal.context(name) if name else contextlib.nullcontext()


def train(places: dict, steps: int = 5) -> list[float]:
    """places: which signal each piece of the model (and the data) is made under."""
    params = []
    for i, t in enumerate(INIT):
        with signal(places.get(f"p{i}")):
            params.append(gtmpi.tensor(t, requires_grad=True))
    opt = gtmpi.optim.SGD(params, lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        with signal(places.get("data")):
            x, y = gtmpi.tensor(X), gtmpi.tensor(Y)
        opt.zero_grad()
        with signal(places.get("stage0")):
            h = F.linear(x, params[0], params[1]).relu()
        with signal(places.get("stage1")):
            loss = F.cross_entropy(F.linear(h, params[2], params[3]), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def collectives() -> dict:
    total = {}
    for s in gtmpi.debug.worker_stats().values():
        for kind, (count, nbytes) in s["collectives"].items():
            total[kind] = total.get(kind, 0) + count
    return total


reference = train({})
print(f"one worker          losses {np.round(reference, 4).tolist()}")
patterns = {
    "data_parallel": {"data": "data", **{f"p{i}": "weights" for i in range(4)}},
    "tensor_parallel": {"data": "weights", "p0": "col", "p1": "col", "p2": "row", "p3": "weights"},
    "pipeline": {"data": "stage0", "p0": "stage0", "p1": "stage0", "p2": "stage1",
                 "p3": "stage1", "stage0": "stage0", "stage1": "stage1"},
}
if len(gtmpi.info()["workers"]) >= 4:  # one 2 × 2 mesh: batch over dp, the MLP over tp
    patterns["dp_tp"] = {"data": "act", "p0": "col", "p1": "col", "p2": "row", "p3": "rep"}
for name, places in patterns.items():
    gtmpi.load_config(os.path.join(HERE, "..", "configs", f"{name}.yaml"))
    before = collectives()
    losses = train(places)
    ran = {k: v - before.get(k, 0) for k, v in collectives().items() if v != before.get(k, 0)}
    same = np.allclose(losses, reference, rtol=1e-4)
    print(f"{name:<19} losses {np.round(losses, 4).tolist()}  same: {same}  collectives: {ran}")
