"""One rank of a test world started by mpirun over SSH: says where it runs, as whom, with which
forwarded variable, and sums the ranks with the others (an allreduce across the pods)."""

import os
import socket

from mpi4py import MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.Get_rank())
print(
    f"rank {comm.Get_rank()} of {comm.Get_size()} on {socket.gethostname()} uid={os.getuid()} "
    f"probe={os.environ.get('BERTH_PROBE')} sum={total}",
    flush=True,
)
