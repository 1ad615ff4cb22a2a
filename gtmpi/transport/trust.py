"""What a server's processes and its clients keep from each other below MPI.

UCX's cross-memory attach lets one process read another's memory in place (process_vm_readv,
the zero-copy rendezvous between processes of one host): when the other dies mid-transfer, the
reading process aborts. Between a server and its clients that ended the server's rank 0 when
an uploading client was killed. So a server's ranks and its clients copy through shared
memory instead. It must be set before MPI starts and before UCX's libraries read their
settings, which happens while gtmpi's own modules load: gtmpi's first lines call it. A UCX_TLS
of the user's own is left as it is.
"""
from __future__ import annotations

import os
import sys


def shares_a_server(argv: list[str], env: dict) -> bool:
    """Whether this process is a rank of ``python [options] -m gtmpi.server`` or a client of
    one (GTMPI_CONNECT)."""
    i = argv.index("-m") + 1 if "-m" in argv else len(argv)
    return argv[i:i + 1] == ["gtmpi.server"] or bool(env.get("GTMPI_CONNECT"))


def no_reads_in_place() -> None:
    if shares_a_server(sys.orig_argv, os.environ):
        os.environ.setdefault("UCX_TLS", "^cma")
