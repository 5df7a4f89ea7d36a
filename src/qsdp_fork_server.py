"""The first import of qsdp's workers' fork server (:data:`qsdp.worker_start.PRELOAD`), and of
no other process: the server runs its imports on one intra-op thread. A module of its own, outside
the ``qsdp`` package, because importing anything inside it runs the package's imports first.

GNU OpenMP (torch's CPU thread pool on Linux) is not safe across ``fork``: a child forked after
its parent ran a parallel region inherits the pool's bookkeeping without its threads, and its
own first parallel region waits forever on them. A worker forked from a server that ran any
torch operator large enough to be split (at import, by torch or by any module it preloads) then
deadlocks in its first such operator, whatever thread count it sets. With one thread the server
never enters a parallel region, so no pool exists to be inherited; each forked worker sets the
thread count a spawned worker would have started with (:data:`INTRA_OP_THREADS`) before it runs
its job (:func:`qsdp.worker_start.run_entry`).
"""

from __future__ import annotations

import torch

__all__ = ["INTRA_OP_THREADS"]

# What torch chose for this interpreter (OMP_NUM_THREADS, else the machine's cores): the server's
# environment is the launcher's (qsdp.worker_start.start_method), so it is what a spawned worker has.
INTRA_OP_THREADS = torch.get_num_threads()
torch.set_num_threads(1)
