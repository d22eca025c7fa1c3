"""This worker process as one rank of an MPI world (mpi4py): who it is, what the ranks share at
start, and how one rank ends them all.

MPI is used for little: the ranks' identities and the engine config (once, at start), the
address of the collectives' rendezvous, and `Abort`. Everything per step goes through
torch.distributed (`pyexecutor/rank.py`). MPI is kept out of the waits that can be long: a
rank blocked in MPI spins on its core, one blocked in gloo sleeps.

One world, one fate: a rank that fails on its own (not in a failure all ranks agreed on) ends
the world with `Abort`, and mpiexec then ends every rank, wherever it runs; a world whose
ranks hang in a collective for a peer that is gone would otherwise hold its model forever.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import NoReturn

from berth.engine.config import EngineConfig
from berth.engine.pyexecutor.rank import join_world, open_rendezvous, rank_config

logger = logging.getLogger(__name__)


class MpiRank:
    def __init__(self, expected_size: int) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        if self.size != expected_size:
            raise RuntimeError(
                f"started as one of {self.size} MPI ranks for a world of {expected_size}: start it with "
                f"`mpiexec -n {expected_size}`"
            )
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        local.Free()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def members(self) -> tuple[tuple[int, int, str], ...] | None:
        """(rank, pid, host) of every rank, on rank 0 (None elsewhere)."""
        gathered = self.comm.gather((self.rank, os.getpid(), socket.gethostname()), root=0)
        return tuple(gathered) if gathered is not None else None

    def share(self, value: object) -> object:
        """Rank 0's `value`, on every rank."""
        return self.comm.bcast(value, root=0)

    def join_collectives(self, config: EngineConfig):
        """This rank's config and its `TensorParallelGroup`. The rendezvous is on rank 0's host:
        127.0.0.1 when every rank is on it, else its fully qualified name (a worker pod's DNS
        name, which every other pod resolves)."""
        config = rank_config(config, self.local_rank, self.local_size)
        store = address = None
        if self.is_leader:
            host = "127.0.0.1" if self.local_size == self.size else socket.getfqdn()
            store, address = open_rendezvous(host, self.size)
        address = self.share(address)
        return config, join_world(self.rank, self.size, address, config, store)

    def abort(self, code: int = 1) -> NoReturn:
        """Ends every rank of the world (mpiexec kills them) and this process."""
        logger.error("rank %d ends the world (MPI Abort %d)", self.rank, code)
        self.comm.Abort(code)
        os._exit(code)  # not reached: Abort does not return
