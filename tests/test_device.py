"""Device selection: node-local worker index from SLURM or MPI, GPU choice, GTMPI_DEVICE."""
from __future__ import annotations

import pytest
import torch

from gtmpi.worker.device import local_worker_index, select_device


def test_index_from_mpi_node_split():
    # node with the dispatcher (rank 0) and workers 1, 2, 3
    assert [local_worker_index({}, r, [0, 1, 2, 3]) for r in (1, 2, 3)] == [0, 1, 2]
    # a second node holding workers 4..7
    assert [local_worker_index({}, r, [4, 5, 6, 7]) for r in (4, 5, 6, 7)] == [0, 1, 2, 3]


def test_index_from_slurm_localid():
    # srun puts the dispatcher at local id 0 of the first node: its workers start at 1
    assert local_worker_index({"SLURM_LOCALID": "1"}, 1, [0, 1, 2]) == 0
    assert local_worker_index({"SLURM_LOCALID": "4"}, 4, [0, 1, 2, 3, 4]) == 3
    # other nodes have no dispatcher: local id is the index
    assert local_worker_index({"SLURM_LOCALID": "0"}, 5, [5, 6]) == 0
    assert local_worker_index({"SLURM_LOCALID": "3"}, 8, [5, 6, 7, 8]) == 3


def test_select_device():
    assert select_device({}, 0, 0) == torch.device("cpu")
    assert select_device({}, 2, 4) == torch.device("cuda", 2)
    assert select_device({}, 5, 4) == torch.device("cuda", 1)
    # SLURM binding one GPU per task: every task sees its own GPU as cuda:0
    assert select_device({}, 3, 1) == torch.device("cuda", 0)
    assert select_device({"GTMPI_DEVICE": "cpu"}, 1, 8) == torch.device("cpu")
    assert select_device({"GTMPI_DEVICE": "CUDA"}, 1, 8) == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="no visible GPU"):
        select_device({"GTMPI_DEVICE": "cuda"}, 0, 0)
    with pytest.raises(ValueError, match="GTMPI_DEVICE"):
        select_device({"GTMPI_DEVICE": "tpu"}, 0, 1)
