"""The sbatch scripts, run with stand-ins for srun and scontrol: the tasks they start."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(tmp_path, name: str, env: dict) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'n1\\nn2\\nn3\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\necho "SRUN $*"\n'
                                  '[ -n "$SLURM_HOSTFILE" ] && cat "$SLURM_HOSTFILE"\nexit 0\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
    proc = subprocess.run(["bash", str(ROOT / "slurm" / name), "train.py", "--lr", "3e-4"],
                          capture_output=True, text=True, timeout=30, env=full_env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_single_node_starts_one_dispatcher_and_one_worker_per_gpu(tmp_path):
    out = run_script(tmp_path, "single_node.sbatch", {"SLURM_GPUS_ON_NODE": "4"})
    assert "SRUN --ntasks=5 " in out
    assert out.strip().endswith("python -m gtmpi train.py --lr 3e-4")


def test_multi_node_puts_the_dispatcher_beside_the_first_nodes_workers(tmp_path):
    out = run_script(tmp_path, "multi_node.sbatch",
                     {"SLURM_GPUS_ON_NODE": "4", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "n[1-3]"})
    lines = out.splitlines()
    assert lines[0].startswith("SRUN --distribution=arbitrary --ntasks=13 ")
    assert lines[0].endswith("python -m gtmpi train.py --lr 3e-4")
    hosts = lines[1:]
    assert hosts == ["n1"] * 5 + ["n2"] * 4 + ["n3"] * 4
