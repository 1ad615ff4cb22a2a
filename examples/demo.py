"""gtmpi in one screen. Run it as:  mpiexec -n 3 python examples/demo.py  (or plain python).

Rank 0 runs this file; the other ranks became workers when gtmpi was imported.
"""
import time

import gtmpi
import gtmpi.nn as nn
import gtmpi.nn.functional as F

world = gtmpi.info()
print(f"{len(world['workers'])} worker(s):",
      ", ".join(f"rank {r} on {w['device']}" for r, w in sorted(world["workers"].items())))

# Tensors look like torch's. Shapes are known here at once; the data lives on a worker.
gtmpi.manual_seed(0)
x = gtmpi.randn(4, 3)
w = gtmpi.tensor([[1.0, -1.0], [0.5, 2.0], [0.0, 1.0]], requires_grad=True)
y = (x @ w).relu() + 1
print("y.shape", y.shape, y.dtype)   # no waiting: nothing has been read yet
print(y)                              # a read: waits for the worker, prints like torch

# Ops return at once; only reads wait. 10,000 ops, one read:
start = time.perf_counter()
acc = gtmpi.zeros(64, 64)
for _ in range(10_000):
    acc = acc + 1.0
print(f"10,000 adds issued and read back in {time.perf_counter() - start:.3f} s:", acc[0, 0].item())

# Autograd: a tape per forward pass in the client; gradient ops run on the worker.
y.sum().backward()
print("dy/dw", w.grad.tolist())

# A few training steps of a small model.
model = nn.Sequential(nn.Linear(3, 16), nn.GELU(), nn.Linear(16, 1))
opt = gtmpi.optim.AdamW(model.parameters(), lr=0.05)
target = (x * gtmpi.tensor([1.0, -2.0, 0.5])).sum(dim=1, keepdim=True)
for step in range(1, 31):
    loss = F.mse_loss(model(x), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 0:
        print(f"step {step}: loss {loss.item():.5f}")

# A shape error is raised right here, at this line, like torch:
try:
    x @ x
except RuntimeError as e:
    print("shape error:", e)

# A failure on a worker is raised at the next read that depends on it, naming this line:
huge = gtmpi.zeros(1 << 48)           # 1 PiB: no worker can hold it
try:
    (huge + 1).sum().item()
except gtmpi.WorkerError as e:
    print("worker error:", e)
print("the session carries on:", (gtmpi.arange(5) * 2).tolist())

gtmpi.debug.print_worker_stats()
