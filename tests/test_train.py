"""examples/gpt/train.py as a user runs it: the tiny GPT's losses on one worker, falling below
the unigram entropy, and a run stopped and resumed from its checkpoint continuing the same
curve exactly. (Every config's layout giving one worker's losses, in strict placement, is
tests/test_dryrun.py's: the real run it sets against the dry run.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import mpiexec, run_job

import gtmpi

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
serial = pytest.mark.skipif(len(gtmpi.info()["workers"]) > 1 or mpiexec() is None,
                            reason="starts its own jobs; run once, from the serial suite")

# jobs on a 2-core machine: their pace is the machine's, busy or idle, so each test gets more
# than the suite's 120 s (its jobs stop themselves at 240 s)
pytestmark = pytest.mark.timeout(300)


def train(tmp_path, *args: str, n: int | None = None, env: dict | None = None) -> dict:
    # float32 everywhere: on GPUs train.py's default bf16 rounds a pipeline's micro-batch sums
    # differently from one worker's whole batch (by one bf16 step of the loss)
    args = (*args, "--dtype", "fp32")
    body = f"""
        import runpy, sys
        sys.argv = ["train.py", *{list(args)!r}]
        runpy.run_path({str(ROOT / "examples/gpt/train.py")!r}, run_name="__main__")
    """
    proc, _ = run_job(tmp_path, body, 240, n=n, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory) -> dict:
    return train(tmp_path_factory.mktemp("one"), "--steps", str(STEPS), "--log-every", "2")


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
def test_a_sharded_fsdp_checkpoint_resumes_on_one_worker(tmp_path, one_worker):
    """--sharded: two workers under fsdp.yaml each write the halves they hold of the weights
    and of AdamW's moments; a run on one worker (another layout) reads them whole and goes on
    along the same curve."""
    ckpt = tmp_path / "ckpt"
    first = train(tmp_path, "--steps", str(STEPS), "--stop-at", "3", "--checkpoint", str(ckpt),
                  "--sharded", n=3, env={"GTMPI_CONFIG": str(ROOT / "configs/fsdp.yaml"),
                                         "GTMPI_PLACEMENT": "strict"})
    assert first["workers"] == 2 and len(first["losses"]) == 3
    assert {f.split(".")[-2] for f in os.listdir(ckpt) if f.endswith(".pt")} == {"rank1", "rank2"}
    resumed = train(tmp_path, "--steps", str(STEPS), "--checkpoint", str(ckpt), "--sharded",
                    "--resume")
    assert resumed["workers"] == 1
    assert resumed["losses"] == pytest.approx(one_worker["losses"], rel=1e-5)


@serial
def test_held_out_loss_falls_clearly_below_the_unigram_entropy(tmp_path):
    out = train(tmp_path, "--steps", "60", "--log-every", "20")
    assert out["val_loss"] < out["unigram_entropy"] - 0.5, out
