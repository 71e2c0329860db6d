"""monarch_nb: drive a mesh of PyTorch rank processes from one notebook.

Controller side::

    from monarch_nb import Mesh
    mesh = Mesh.start(n=4)
    mesh.run(fn, *args)

Rank side (inside ``%%monarch`` cells and functions sent with ``mesh.run``)::

    import monarch_nb as mnb
    mnb.rank(), mnb.world_size(), mnb.local_rank(), mnb.device(), mnb.incarnation()
    mnb.mesh_rank()     # the mesh's stable rank number (mnb.rank(): the torch group's)
    mnb.log(loss=0.3)   # feeds the live dashboard (non-blocking)

In IPython: ``%load_ext monarch_nb`` adds ``%monarch`` and ``%%monarch``.

A rank process imports this package too (``python -m monarch_nb.worker``), so
the root imports only the rank side and the shared base eagerly; the
controller-side names (``Mesh``, ``SubMesh``, ``RankResults``) are loaded on
first use (PEP 562). A rank therefore never loads the controller or the front
ends (a contract in pyproject.toml, tests/test_layers.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import chaos, elastic
from .engine.context import device, incarnation, local_rank, mesh_rank, rank, world_size
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

if TYPE_CHECKING:
    from .mesh import Mesh, SubMesh, stop_all
    from .results import Lost, RankResults

__version__ = "0.1.0"

__all__ = [
    "Mesh", "SubMesh", "RankResults", "Lost", "MeshFuture", "chaos", "elastic",
    "MonarchError", "MeshNotRunning", "RemoteError", "RankErrors", "RankDied",
    "MembershipChanged", "CallTimeout", "UsageError",
    "rank", "world_size", "mesh_rank", "local_rank", "device", "incarnation", "log",
    "load_ipython_extension", "unload_ipython_extension", "stop_all",
]

# Names loaded on first use, and the module that defines each. (The atexit
# stop of live meshes is registered where a mesh is made: mesh.py.)
_LAZY = {"Mesh": "monarch_nb.mesh", "SubMesh": "monarch_nb.mesh",
         "stop_all": "monarch_nb.mesh", "RankResults": "monarch_nb.results",
         "Lost": "monarch_nb.results"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'monarch_nb' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython: Any) -> None:
    from .ui.magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .ui.magics import unload

    unload(ipython)
