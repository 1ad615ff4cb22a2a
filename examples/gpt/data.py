"""Byte-level text that needs no download: sentences generated from a small grammar with a
fixed seed (who did what with how many of which thing, and sums with their answers), so a
model has structure to learn (words, agreement, arithmetic) and a held-out split to be judged
on. The same seed gives the same bytes on every machine.
"""
from __future__ import annotations

import random

import torch

NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Radia",
         "Ken", "Margaret", "Dennis", "Leslie", "Tony", "Fran", "Niklaus"]
VERBS = [("found", "finds"), ("sorted", "sorts"), ("counted", "counts"), ("wrote", "writes"),
         ("shipped", "ships"), ("tested", "tests"), ("merged", "merges"), ("read", "reads")]
THINGS = ["tensor", "kernel", "packet", "record", "branch", "socket", "matrix", "vector",
          "thread", "buffer", "ticket", "commit"]
PLACES = ["on the first worker", "on every GPU", "in the trace", "before the barrier",
          "after the all-reduce", "in the second stage", "on rank zero", "in one batch"]


def sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"{a} plus {b} is {a + b}."
    name, (past, present) = rng.choice(NAMES), rng.choice(VERBS)
    n = rng.randint(1, 12)
    thing = rng.choice(THINGS) + ("" if n == 1 else "s")
    if kind < 0.7:
        return f"{name} {past} {n} {thing} {rng.choice(PLACES)}."
    return f"Every day {name} {present} {n} {thing}."


def text(n_bytes: int, seed: int) -> bytes:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        s = sentence(rng) + (" " if rng.random() < 0.8 else "\n")
        parts.append(s)
        size += len(s)
    return "".join(parts).encode()[:n_bytes]


def splits(n_bytes: int = 1 << 21, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) as uint8 tensors: 90% and 10% of the bytes, drawn from different
    seeds so that no sentence sequence is shared."""
    held = n_bytes // 10
    return (torch.frombuffer(bytearray(text(n_bytes - held, seed)), dtype=torch.uint8),
            torch.frombuffer(bytearray(text(held, seed + 1)), dtype=torch.uint8))


def unigram_entropy(data: torch.Tensor) -> float:
    """Nats per byte of the bytes' own frequencies: the loss of a model that learned only them."""
    counts = torch.bincount(data.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def batch(data: torch.Tensor, size: int, seq: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``seq`` + 1 bytes, chosen by (seed, step) alone: a resumed run sees
    the batches the uninterrupted one would have."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (size,), generator=gen)
    windows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


