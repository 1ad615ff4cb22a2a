"""Nothing silent: configs that cannot be ignored. A misspelt signal name, a config that needs
more workers than launched or leaves some idle, a config train.py does not understand: each is
said, never run through quietly on fewer workers than meant."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import gtmpi
from conftest import mpiexec, run_job

ROOT = Path(__file__).resolve().parent.parent
serial = pytest.mark.skipif(len(gtmpi.info()["workers"]) > 1 or mpiexec() is None,
                            reason="starts its own jobs; run once, from the serial suite")


@serial
def test_config_signals_the_program_never_used_are_named_at_exit(tmp_path):
    proc, _ = run_job(tmp_path, """
        import warnings, torch, gtmpi
        gtmpi.load_config({"dat": {"shard": {"axis": 0, "workers": [0, 1]}},
                           "weights": {"shard": {"workers": [0, 1], "replicated": True}}})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = gtmpi.signal.tensor(torch.ones(4, 2), "data")
        print(caught[0].message)
        with gtmpi.signal.context("weights"):
            w = gtmpi.ones(2)
        print((x * w).sum().item())
    """, 90)
    assert proc.returncode == 0, proc.stderr
    assert "signal 'data' is not in the config (did you mean 'dat'?)" in proc.stdout
    assert "gtmpi: the config's signal(s) dat were never used by the program; it used data, " \
           "which the config lacks" in proc.stderr


@serial
def test_a_config_needing_more_workers_says_how_many_ranks_to_launch(tmp_path):
    proc, _ = run_job(tmp_path, """
        import gtmpi
        gtmpi.load_config({"wide": {"shard": {"axis": 0, "workers": [0, 1, 2, 3]}}})
    """, 90)
    assert proc.returncode != 0
    assert "the config needs 4: launch 5 ranks (mpiexec -n 5" in proc.stderr, proc.stderr


@serial
def test_workers_a_config_leaves_idle_are_said_once(tmp_path):
    proc, _ = run_job(tmp_path, """
        import gtmpi
        gtmpi.load_config({"one": {"shard": {"workers": [0]}}})
        gtmpi.load_config({"also": {"shard": {"workers": [0]}}})
    """, 90, n=4)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("places nothing on worker(s) 1, 2 of 3: they stay idle") == 1


@serial
@pytest.mark.parametrize("config, said", [
    ("dat:\n  shard: {axis: 0, workers: [0]}\nweight:\n  shard: {workers: [0], "
     "replicated: true}\n", "'dat' (did you mean 'data'?), 'weight' (did you mean 'weights'?)"),
    (None, "name no layout this script runs")])
def test_train_py_refuses_a_config_it_does_not_understand(tmp_path, config, said):
    path = tmp_path / "c.yaml"
    if config is None:  # tensor_parallel.yaml is for the MLP, not the GPT's signals
        path = ROOT / "configs" / "tensor_parallel.yaml"
    else:
        path.write_text(config)
    proc, _ = run_job(tmp_path, f"""
        import runpy, sys
        sys.argv = ["train.py", "--steps", "2"]
        runpy.run_path({str(ROOT / "examples/gpt/train.py")!r}, run_name="__main__")
    """, 120, n=3, env={"GTMPI_CONFIG": str(path)})
    assert proc.returncode != 0
    assert said in proc.stderr, proc.stderr[-2000:]


def _train_py(tmp_path, *args: str, n: int | None = None):
    return run_job(tmp_path, f"""
        import runpy, sys
        sys.argv = ["train.py", *{list(args)!r}]
        runpy.run_path({str(ROOT / "examples/gpt/train.py")!r}, run_name="__main__")
    """, 200, n=n)[0]


@serial
def test_resume_says_what_it_resumes_from_and_refuses_a_bad_checkpoint(tmp_path):
    ckpt = tmp_path / "run.pt"
    common = ("--layers", "1", "--steps", "6", "--log-every", "1", "--dtype", "fp32")
    fresh = _train_py(tmp_path, *common, "--checkpoint", str(ckpt), "--resume",
                      "--save-every", "3", "--stop-at", "3")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert f"no checkpoint at {ckpt} yet: training from step 0" in fresh.stdout
    import torch
    saved = torch.load(ckpt, weights_only=False)
    assert saved["step"] == 3 and len(saved["losses"]) == 3  # every loss up to its step
    resumed = _train_py(tmp_path, *common, "--checkpoint", str(ckpt), "--resume")
    assert resumed.returncode == 0 and f"resumed from {ckpt} at step 3" in resumed.stdout
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"")
    out = _train_py(tmp_path, *common, "--checkpoint", str(bad), "--resume")
    assert out.returncode != 0
    assert f"cannot resume from {bad}: not a readable checkpoint" in out.stderr
    torch.save({"weights": 1}, bad)
    out = _train_py(tmp_path, *common, "--checkpoint", str(bad), "--resume")
    assert f"cannot resume from {bad}: it lacks model, optimizer, step, losses" in out.stderr
