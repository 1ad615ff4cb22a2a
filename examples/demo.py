"""gtmpi in one screen. Run it as:  mpiexec -n 3 python examples/demo.py  (or plain python).

Rank 0 runs this file; the other ranks became workers when gtmpi was imported.
"""
import time

import gtmpi

world = gtmpi.info()
print(f"{len(world['workers'])} worker(s):",
      ", ".join(f"rank {r} on {w['device']}" for r, w in sorted(world["workers"].items())))

# Tensors look like torch's. Shapes are known here at once; the data lives on a worker.
gtmpi.manual_seed(0)
x = gtmpi.randn(4, 3)
w = gtmpi.tensor([[1.0, -1.0], [0.5, 2.0], [0.0, 1.0]])
y = (x @ w).relu() + 1
print("y.shape", y.shape, y.dtype)   # no waiting: nothing has been read yet
print(y)                              # a read: waits for the worker, prints like torch

# Ops return at once; only reads wait. 10,000 ops, one read:
start = time.perf_counter()
acc = gtmpi.zeros(64, 64)
for _ in range(10_000):
    acc = acc + 1.0
print(f"10,000 adds issued and read back in {time.perf_counter() - start:.3f} s:", acc[0, 0].item())

# Reductions, indexing, in-place updates.
print("column means", y.mean(dim=0).tolist())
y[y > 2] = 2.0
print("clipped max", y.max().item(), "argmax per row", y.argmax(dim=1).tolist())

# A shape error is raised right here, at this line, like torch:
try:
    x @ x
except RuntimeError as e:
    print("shape error:", e)

# A failure on a worker is raised at the next read that depends on it, naming this line:
huge = gtmpi.zeros(1 << 40)           # 4 TiB: no worker can hold it
try:
    (huge + 1).sum().item()
except gtmpi.WorkerError as e:
    print("worker error:", str(e).splitlines()[0][:160])
print("the session carries on:", (gtmpi.arange(5) * 2).tolist())

gtmpi.debug.print_worker_stats()
