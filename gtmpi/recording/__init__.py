"""Trace recording, at the bottom of the layers: event kinds and the per-rank recorder that
workers, the dispatcher and the transports write to, rank 0's collection of a run into one
file (session), the file's format, and GT's text instruction log. The user's switch
(``gtmpi.trace.start``) and the readers behind ``gtmpi-trace`` are in ``gtmpi.trace``."""
