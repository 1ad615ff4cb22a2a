"""examples/gpt/train.py as a user runs it: the tiny GPT's losses on one worker, the same losses
with the data-parallel, Megatron tensor-parallel and 1F1B pipeline configs on two workers,
DP × TP and TP × PP on four and the seed's TP=2 × PP=4 on eight, in strict placement, and a
run stopped and resumed from its checkpoint continuing the same curve exactly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import mpiexec, run_job

import gtmpi

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
serial = pytest.mark.skipif(len(gtmpi.info()["workers"]) > 1 or mpiexec() is None,
                            reason="starts its own jobs; run once, from the serial suite")

# jobs of up to 9 ranks on a 2-core machine: their pace is the machine's, busy or idle, so each
# test gets more than the suite's 120 s (its jobs stop themselves at 240 s)
pytestmark = pytest.mark.timeout(300)


def train(tmp_path, *args: str, n: int | None = None, config: str | None = None) -> dict:
    # float32 everywhere: on GPUs train.py's default bf16 rounds a pipeline's micro-batch sums
    # differently from one worker's whole batch (by one bf16 step of the loss)
    args = (*args, "--dtype", "fp32")
    body = f"""
        import runpy, sys
        sys.argv = ["train.py", *{list(args)!r}]
        runpy.run_path({str(ROOT / "examples/gpt/train.py")!r}, run_name="__main__")
    """
    env = {"GTMPI_PLACEMENT": "strict"}
    if config:
        env["GTMPI_CONFIG"] = str(ROOT / "configs" / config)
    proc, _ = run_job(tmp_path, body, 240, n=n, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory) -> dict:
    return train(tmp_path_factory.mktemp("one"), "--steps", str(STEPS), "--log-every", "2")


@serial
@pytest.mark.parametrize("config, mode, workers", [
    ("data_parallel.yaml", "data parallel", 2), ("gpt_tp2.yaml", "tensor parallel", 2),
    ("pipeline.yaml", "2 pipeline stages", 2), ("dp_tp.yaml", "tensor parallel", 4),
    ("gpt_tp2_pp2.yaml", "2 pipeline stages", 4)])
def test_parallel_configs_give_one_workers_losses(tmp_path, one_worker, config, mode, workers):
    out = train(tmp_path, "--steps", str(STEPS), "--log-every", "2", n=workers + 1,
                config=config)
    assert out["workers"] == workers and out["mode"].startswith(mode)
    assert out["losses"] == pytest.approx(one_worker["losses"], rel=1e-4)
    assert out["val_loss"] == pytest.approx(one_worker["val_loss"], rel=1e-4)


@serial
def test_the_seeds_tp2_pp4_layout_on_8_workers_gives_one_workers_losses(tmp_path):
    """The seed's Mini-GPT layout, TP=2 × PP=4 with 1F1B over 8 micro-batches, on 9 ranks of
    this machine's CPUs (4 blocks of the tiny size, one per stage)."""
    args = ("--layers", "4", "--steps", "4", "--log-every", "2")
    want = train(tmp_path, *args)
    out = train(tmp_path, *args, "--micro-batches", "8", n=9, config="gpt_tp2_pp4.yaml")
    assert out["workers"] == 8 and "4 pipeline stages" in out["mode"] and \
        "tensor parallel in each" in out["mode"] and "blocks per stage 1/1/1/1" in out["mode"]
    assert out["losses"] == pytest.approx(want["losses"], rel=1e-4)


@serial
def test_resumed_run_continues_the_same_curve(tmp_path, one_worker):
    ckpt = str(tmp_path / "ckpt.pt")
    first = train(tmp_path, "--steps", str(STEPS), "--stop-at", "3", "--checkpoint", ckpt)
    assert len(first["losses"]) == 3
    resumed = train(tmp_path, "--steps", str(STEPS), "--checkpoint", ckpt, "--resume")
    assert resumed["losses"] == one_worker["losses"]
    losses = one_worker["losses"]
    assert losses[-1] < losses[0] and one_worker["tokens_per_s"] > 0


@serial
def test_held_out_loss_falls_clearly_below_the_unigram_entropy(tmp_path):
    out = train(tmp_path, "--steps", "60", "--log-every", "20")
    assert out["val_loss"] < out["unigram_entropy"] - 0.5, out
