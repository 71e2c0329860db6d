"""monarch_nb: drive a mesh of PyTorch rank processes from one notebook.

Controller side::

    from monarch_nb import Mesh
    mesh = Mesh.start(n=4)
    mesh.run(fn, *args)

Rank side (inside ``%%monarch`` cells and functions sent with ``mesh.run``)::

    import monarch_nb as mnb
    mnb.rank(), mnb.world_size(), mnb.local_rank(), mnb.device(), mnb.incarnation()
    mnb.log(loss=0.3)   # feeds the live dashboard (non-blocking)

In IPython: ``%load_ext monarch_nb`` adds ``%monarch`` and ``%%monarch``.
"""

from __future__ import annotations

import atexit
from typing import Any

from . import chaos, elastic
from .engine.context import device, incarnation, local_rank, rank, world_size
from .engine.metrics import log
from .errors import (
    CallTimeout,
    MembershipChanged,
    MeshNotRunning,
    MonarchError,
    RankDied,
    RankErrors,
    RemoteError,
    UsageError,
)
from .futures import MeshFuture
from .mesh import Mesh, RankResults, SubMesh, stop_all

__version__ = "0.1.0"

__all__ = [
    "Mesh", "SubMesh", "RankResults", "MeshFuture", "chaos", "elastic",
    "MonarchError", "MeshNotRunning", "RemoteError", "RankErrors", "RankDied",
    "MembershipChanged", "CallTimeout", "UsageError",
    "rank", "world_size", "local_rank", "device", "incarnation", "log",
    "load_ipython_extension", "unload_ipython_extension",
]

# Kernel shutdown and restart end the interpreter normally: stop ranks then.
# (A SIGKILLed kernel is covered by the ranks' parent-death signal.)
atexit.register(stop_all)


def load_ipython_extension(ipython: Any) -> None:
    from .ui.magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .ui.magics import unload

    unload(ipython)
