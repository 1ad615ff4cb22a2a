"""The worker process of the embedded default on a GPU (transport.pipe), started by the user's
process as ``python -m gtmpi.worker.child FD DEVICE``: FD is its end of the socket pair."""
from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection

import torch

from ..transport.pipe import ParentLink
from .executor import Executor


def main(fd: int, device_name: str) -> None:
    # Ctrl-C reaches the whole process group: the user's process decides, and this one ends
    # when that one does (its end of the socket pair closes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the parent decides, as on Ctrl-C
    link = ParentLink(Connection(fd))
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    executor = Executor(1, device, link)  # no hello: the parent went on without waiting
    try:
        link.serve(executor)
    except (EOFError, ConnectionError):
        pass  # the user's process is gone: nobody is left to serve


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
