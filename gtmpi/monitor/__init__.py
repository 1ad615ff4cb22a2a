"""Live figures of a running job: workers push theirs to a hub on rank 0 (a server's, or an
ordinary run's started with GTMPI_MONITOR=PORTFILE), and ``gtmpi-trace top PORTFILE`` shows
them. Plain TCP and threads, no MPI: the job's own MPI traffic is never touched.

  push.py  a worker's thread that sends its figures every interval
  hub.py   rank 0's thread: the port file, the token, and the latest figures for every monitor
  top.py   the terminal view
"""
