"""Train an MLP classifier on a synthetic task made here, with gtmpi.

    python examples/train_mlp.py            # embedded worker
    mpiexec -n 3 python examples/train_mlp.py

The task: 2-D points on 4 interleaved spiral arms, lifted to 16 features by a fixed random map.
"""
import math
import sys
import time

import torch

import gtmpi
import gtmpi.nn as nn
import gtmpi.nn.functional as F

CLASSES, FEATURES, STEPS, BATCH = 4, 16, 600, 256


def spirals(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    radius = torch.rand(n, generator=gen) * 0.9 + 0.1
    angle = radius * 2 * math.pi + labels * (2 * math.pi / CLASSES)
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], 1)
    points += 0.02 * torch.randn(n, 2, generator=gen)
    lift = torch.randn(2, FEATURES, generator=torch.Generator().manual_seed(0))
    return torch.cat([points, torch.tanh(points @ lift)], 1)[:, :FEATURES], labels


def progress(step: int, loss: float, seconds: float, width: int = 30) -> None:
    done = int(width * step / STEPS)
    rate = step * BATCH / seconds
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] step {step:4d}/{STEPS}  "
                     f"loss {loss:.4f}  {rate:,.0f} samples/s")
    sys.stdout.flush()


gen = torch.Generator().manual_seed(1)
x_train, y_train = spirals(8192, gen)
x_test, y_test = spirals(2048, gen)
x_train, y_train = gtmpi.tensor(x_train), gtmpi.tensor(y_train)   # uploaded once

gtmpi.manual_seed(0)
model = nn.Sequential(nn.Linear(FEATURES, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                      nn.Linear(128, CLASSES))
opt = gtmpi.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-4)
sched = gtmpi.optim.lr_scheduler.CosineWithWarmup(opt, warmup_steps=20, total_steps=STEPS)

start = time.perf_counter()
order = torch.randperm(8192, generator=gen)
for step in range(1, STEPS + 1):
    idx = order[(step * BATCH) % 8192:][:BATCH]
    if len(idx) < BATCH:
        order = torch.randperm(8192, generator=gen)
        idx = order[:BATCH]
    batch = gtmpi.tensor(idx)
    loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
    opt.zero_grad()
    loss.backward()
    gtmpi.optim.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    if step % 20 == 0 or step == STEPS:
        progress(step, loss.item(), time.perf_counter() - start)   # the only reads: a scalar
                                                                   # every 20 steps
print(f"\ntrained in {time.perf_counter() - start:.1f} s on {len(gtmpi.info()['workers'])} worker(s)")

model.eval()
with gtmpi.no_grad():
    predicted = model(gtmpi.tensor(x_test)).argmax(dim=1)
    accuracy = (predicted == gtmpi.tensor(y_test)).float().mean().item()
print(f"test accuracy {accuracy:.1%}")
if accuracy < 0.95:
    sys.exit(f"accuracy {accuracy:.1%} is below 95%")
