"""The sbatch scripts, run with stand-ins for srun and scontrol: the tasks they start, with the
PMI plug-in of the MPI in use and the CPUs per task. (tools/slurm-ci, which CI runs, submits
them to a real Slurm.)"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def plugin() -> str:
    """srun's PMI plug-in for the MPI library mpi4py was built with."""
    import mpi4py
    mpi4py.rc.initialize = False
    from mpi4py import MPI
    return "pmix" if "Open MPI" in MPI.Get_library_version() else "pmi2"


def run_script(tmp_path, name: str, env: dict, args=("train.py", "--lr", "3e-4"),
               srun_status: int = 0) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'n1\\nn2\\nn3\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\necho "SRUN $*"\n'
                                  'echo "CPUS $SRUN_CPUS_PER_TASK"\n'
                                  '[ -n "$SLURM_HOSTFILE" ] && cat "$SLURM_HOSTFILE"\n'
                                  '[ -n "$GTMPI_CONFIG" ] && echo "CONFIG $GTMPI_CONFIG"\n'
                                  'echo "HOSTFILE $SLURM_HOSTFILE"\n'
                                  f'exit {srun_status}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    full_env = {**{k: v for k, v in os.environ.items() if k != "GTMPI_CONFIG"},
                "PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
    proc = subprocess.run(["bash", str(ROOT / "slurm" / name), *args],
                          capture_output=True, text=True, timeout=30, env=full_env)
    assert proc.returncode == srun_status, proc.stderr
    return proc.stdout


def test_single_node_starts_one_dispatcher_and_one_worker_per_gpu(tmp_path):
    out = run_script(tmp_path, "single_node.sbatch", {"SLURM_GPUS_ON_NODE": "4",
                                                       "SLURM_CPUS_PER_TASK": "6"})
    lines = out.splitlines()
    assert lines[0].startswith(f"SRUN --mpi={plugin()} --ntasks=5 ")
    assert lines[0].endswith("python -m gtmpi train.py --lr 3e-4")
    assert lines[1] == "CPUS 6"  # srun stopped inheriting --cpus-per-task in Slurm 22.05
    chosen = run_script(tmp_path / "pmix", "single_node.sbatch",
                        {"SLURM_GPUS_ON_NODE": "4", "GTMPI_SRUN_MPI": "pmix"})
    assert chosen.startswith("SRUN --mpi=pmix --ntasks=5 ")


def test_multi_node_puts_the_dispatcher_beside_the_first_nodes_workers(tmp_path):
    out = run_script(tmp_path, "multi_node.sbatch",
                     {"SLURM_GPUS_ON_NODE": "4", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "n[1-3]"})
    lines = out.splitlines()
    assert lines[0].startswith(f"SRUN --mpi={plugin()} --distribution=arbitrary --ntasks=13 ")
    assert lines[0].endswith("python -m gtmpi train.py --lr 3e-4")
    assert lines[1] == "CPUS 1"
    hosts = lines[2:-1]
    assert hosts == ["n1"] * 5 + ["n2"] * 4 + ["n3"] * 4
    assert not os.path.exists(lines[-1].split()[1])  # the hostfile is removed


def test_multi_node_leaves_no_hostfile_when_srun_fails(tmp_path):
    """A job whose srun failed ends with srun's status and takes its hostfile with it."""
    out = run_script(tmp_path, "multi_node.sbatch",
                     {"SLURM_GPUS_ON_NODE": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"},
                     srun_status=3)
    hostfile = out.splitlines()[-1].split()[1]
    assert hostfile and not os.path.exists(hostfile)


def test_gpt_scripts_run_the_seeds_layout_through_the_generic_ones(tmp_path):
    """train_gpt.sbatch (one node of 8 GPUs) and its 2-node variant (4 GPUs each) start the
    same tasks as the generic scripts, with the TP=2 × PP=4 config and the Mini-GPT."""
    common = {"SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_ID": "7"}
    one = run_script(tmp_path / "one", "train_gpt.sbatch", {**common, "SLURM_GPUS_ON_NODE": "8"})
    assert f"SRUN --mpi={plugin()} --ntasks=9 " in one
    assert "python -m gtmpi examples/gpt/train.py --size mini --micro-batches 8 --checkpoint " \
           "gtmpi-gpt.pt --resume train.py" in one
    assert "CONFIG configs/gpt_tp2_pp4.yaml" in one
    two = run_script(tmp_path / "two", "train_gpt_2node.sbatch",
                     {**common, "SLURM_GPUS_ON_NODE": "4", "SLURM_NNODES": "2",
                      "SLURM_JOB_NODELIST": "n[1-2]"}).splitlines()
    assert two[0].startswith(f"SRUN --mpi={plugin()} --distribution=arbitrary --ntasks=9 ")
    assert two[2:11] == ["n1"] * 5 + ["n2"] * 4 and "CONFIG configs/gpt_tp2_pp4.yaml" in two


def test_serve_starts_a_server_on_every_gpu_with_a_private_port_file(tmp_path):
    port = tmp_path / "shared" / "team.port"
    out = run_script(tmp_path, "serve.sbatch", {"SLURM_GPUS_ON_NODE": "4",
                                                "GTMPI_QUOTA_GB": "20"}, args=(str(port),))
    srun = [line for line in out.splitlines() if line.startswith("SRUN")][0]
    assert srun.startswith(f"SRUN --mpi={plugin()} --ntasks=5 ")
    assert srun.endswith(f"python -m gtmpi.server --port-file {port} --bind 0.0.0.0 "
                         "--quota-gb 20")
    assert f"GTMPI_CONNECT={port}" in out
    assert (port.parent.stat().st_mode & 0o777) == 0o700
