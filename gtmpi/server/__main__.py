"""python -m gtmpi.server --port-file PATH [--quota-gb G] [--bind ADDR]   (under mpiexec or srun)
python -m gtmpi.server --stop --port-file PATH              (anywhere the port file is readable)"""
from __future__ import annotations

import argparse
import sys

from ..transport.rendezvous import LOOPBACK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gtmpi.server", description=__doc__.splitlines()[0])
    p.add_argument("--port-file", required=True,
                   help="where to write how to reach the server (readable by its owner only)")
    p.add_argument("--quota-gb", type=float, default=None,
                   help="most GB one client's tensors may hold on each worker (default: none)")
    p.add_argument("--bind", default=LOOPBACK,
                   help="the address the server listens on for clients and monitors (default: "
                        "the loopback, this host only; for clients or workers on other nodes, "
                        "this node's address on their network, or 0.0.0.0 for every interface)")
    p.add_argument("--trace", help="write a trace of the server (a lane per client) at its end")
    p.add_argument("--stop", action="store_true", help="ask the server of PORT_FILE to shut down")
    args = p.parse_args(argv)
    if args.stop:
        from ..transport.rendezvous import dial, read_port_file
        try:
            lines = dial(read_port_file(args.port_file), {"role": "stop"})
        except OSError as e:
            print(f"gtmpi.server: {e}", file=sys.stderr)
            return 2
        answer = lines.recv(timeout_s=10)
        print(f"gtmpi.server: {answer}", file=sys.stderr)
        return 0 if answer and answer.get("stopping") else 1
    import gtmpi  # noqa: F401  (under mpiexec the workers start serving here)
    from . import serve
    serve(args.port_file, args.quota_gb, args.trace, args.bind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
