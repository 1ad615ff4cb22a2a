"""A death notice for a worker killed by a signal.

The MPI launcher ends the job when a rank dies, but its message names a process id, not a
rank, and rank 0 is killed before it can say more. So each worker starts a tiny watcher
process that blocks reading a pipe whose only writer is the worker. A clean exit writes
"bye" first; end-of-file without it means the worker died, and the watcher names its rank.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

_WATCH = ("import sys\n"
          "if sys.stdin.buffer.read() != b'bye':\n"
          "    sys.stderr.write(sys.argv[1] + '\\n')\n")


class DeathNotice:
    def __init__(self, rank: int):
        message = (f"gtmpi: worker rank {rank} (pid {os.getpid()} on {socket.gethostname()}) "
                   "died; the job is ending")
        self._proc = subprocess.Popen([sys.executable, "-c", _WATCH, message],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                      close_fds=True, start_new_session=True)

    def clean_exit(self) -> None:
        self._proc.stdin.write(b"bye")
        self._proc.stdin.close()
