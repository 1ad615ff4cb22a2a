"""python -m gtmpi script.py [args]: run a script under gtmpi's roles explicitly.

Importing gtmpi (below) already sent ranks > 0 off to serve as workers, before the script
runs, so the script may import gtmpi wherever it likes, or late.
"""
import runpy
import sys

import gtmpi  # noqa: F401  (starts this rank's role)

if len(sys.argv) < 2:
    raise SystemExit("usage: python -m gtmpi script.py [args...]")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
