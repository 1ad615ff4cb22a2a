"""Repeated runs replayed without gtmpi.replayable (dispatcher/repeats.py): an unchanged
training loop gives the losses and weights it gives as written, bit for bit, while most of its
instructions reach the worker as replays (graphs through the CPU stand-in); whatever differs
between iterations runs as written, and says so."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gtmpi
from gtmpi.client.runtime import runtime
from test_torch_port import load

G = load("gpt_torch_style_repeats", True)


@pytest.fixture
def auto(monkeypatch):
    """Repeated runs replayed, as CUDA graphs through the CPU stand-in, for one test."""
    monkeypatch.setenv("GTMPI_CUDA_GRAPHS", "emulate")
    gtmpi.debug.auto_replay(True)
    yield runtime().dispatcher.repeats
    gtmpi.debug.auto_replay(False)


def _train(iters: int = 8, accumulate: int = 2, set_to_none: bool = True, dropout: float = 0.0,
           batch_at: dict | None = None, swap_at: int | None = None) -> tuple[list[float], list]:
    """nanoGPT's loop in small: batches sliced from a token array and uploaded, autocast-free
    forward, gradient accumulation, clipping, AdamW with a schedule, zero_grad, loss.item()."""
    gtmpi.manual_seed(0)
    model = G.GPT(G.GPTConfig(dropout=dropout)).to("cuda")
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    data = np.random.default_rng(0).integers(0, 64, 20_000)
    rng = np.random.default_rng(1)
    losses = []
    for it in range(iters):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * (it + 1) / iters  # a schedule: the step's constants change
        batch = (batch_at or {}).get(it, 4)
        for _ in range(accumulate):
            ix = rng.integers(0, len(data) - 33, batch)
            x = gtmpi.stack([gtmpi.from_numpy(data[i:i + 32]) for i in ix]).to("cuda")
            y = gtmpi.stack([gtmpi.from_numpy(data[i + 1:i + 33]) for i in ix]).to("cuda")
            _, loss = model(x, y)
            (loss / accumulate).backward()
        gtmpi.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if it == swap_at:  # new weight tensors: what was kept reads the old ones
            with gtmpi.no_grad():
                model.transformer.ln_f.weight = gtmpi.nn.Parameter(model.transformer.ln_f.weight * 1.0)
            opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
        losses.append(loss.item())
    return losses, [p.detach().cpu_torch() for p in model.parameters()]


def _same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    for p, q in zip(a[1], b[1]):
        assert torch.equal(p, q)


def _replayed(report: str) -> int:
    return int(report.split("instructions, ")[1].split(" replayed")[0].replace(",", ""))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_repeated_loop_gives_the_losses_and_weights_it_gives_as_written(auto, set_to_none):
    gtmpi.debug.auto_replay(False)
    written = _train(set_to_none=set_to_none)
    launches = sum(s["graph_launches"] for s in gtmpi.debug.worker_stats().values())
    gtmpi.debug.auto_replay(True)
    replayed = _train(set_to_none=set_to_none)
    _same(written, replayed)
    report = gtmpi.debug.repeats()
    total = int(report.split("of ")[1].split(" instructions")[0].replace(",", ""))
    assert _replayed(report) > total / 2, report  # most of the loop went out as replays
    stats = gtmpi.debug.worker_stats()
    assert sum(s["graph_launches"] for s in stats.values()) > launches + 8


def test_what_differs_between_iterations_runs_as_written_and_is_counted(auto):
    gtmpi.debug.auto_replay(False)
    written = _train(dropout=0.1, batch_at={5: 3})
    gtmpi.debug.auto_replay(True)
    _same(written, _train(dropout=0.1, batch_at={5: 3}))
    report = gtmpi.debug.repeats()
    assert "as written: not seen before" in report
    assert "as written: an upload or an optimizer's step" in report


def test_new_weights_make_the_runs_that_read_the_old_ones_go(auto):
    gtmpi.debug.auto_replay(False)
    written = _train(iters=10, swap_at=5)
    gtmpi.debug.auto_replay(True)
    _same(written, _train(iters=10, swap_at=5))
    assert runtime().dispatcher.repeats.installed > 0


def test_explain_says_what_was_replayed(auto, capsys):
    _train(iters=4)
    gtmpi.debug.explain()
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("repeated runs")]
    assert line and _replayed(line[0]) > 0


def test_off_nothing_is_held():
    assert runtime().dispatcher.repeats is None
    assert gtmpi.debug.repeats() is None
