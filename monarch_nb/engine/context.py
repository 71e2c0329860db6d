"""Rank-side identity: what ``mnb.rank()`` and friends answer.

Filled once by the worker at start (or lazily from the torch.distributed
environment in a launched script). Importing this module is cheap and never
imports torch.

Non-goals: sockets, execution (loop.py).
"""

from __future__ import annotations

import os
from typing import Any

from ..config import ENV_MESH_RANK
from ..errors import MonarchError

_state: dict[str, Any] = {}


def _set(**values: Any) -> None:
    _state.update(values)


def _get(name: str) -> Any:
    if name not in _state:
        if name in ("rank", "world_size", "local_rank") and "RANK" in os.environ:
            env = {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK"}[name]
            return int(os.environ.get(env, os.environ["RANK"]))
        raise MonarchError(
            f"mnb.{name}() only works inside a rank: run it in a %%monarch cell "
            "or a function passed to mesh.run()"
        )
    return _state[name]


def rank() -> int:
    """This process's rank in its torch.distributed group (0-based):
    ``dist.get_rank()``, ``RANK``. The same as :func:`mesh_rank` unless the
    group went on without some ranks (``min_ranks``): then the group's
    ranks are dense, 0..world_size()-1, in the order of the mesh's."""
    return int(_get("rank"))


def world_size() -> int:
    """Number of ranks in the torch.distributed group now
    (``dist.get_world_size()``, ``WORLD_SIZE``): the mesh's, or fewer while
    the group goes on without lost ranks (``min_ranks``)."""
    return int(_get("world_size"))


def mesh_rank() -> int:
    """This process's rank number in the mesh: stable for the mesh's life
    (what ``--ranks``, ``mesh[i]``, results, ``mesh.status()``, logs and
    the dashboard use), whatever the torch group's size (:func:`rank`)."""
    if "mesh_rank" in _state:
        return int(_state["mesh_rank"])
    if ENV_MESH_RANK in os.environ:
        return int(os.environ[ENV_MESH_RANK])
    return rank()


def local_rank() -> int:
    """Rank among the processes on this host (the device index before pinning)."""
    return int(_get("local_rank"))


def incarnation() -> int:
    """0 for the first process of a rank, +1 for each respawn."""
    return int(_state.get("incarnation", os.environ.get("MONARCH_NB_INCARNATION", 0)))


def in_elastic_loop() -> bool:
    """The main thread runs an ``mnb.elastic.run`` loop now: after a peer's
    death this rank carries on in place (the control thread says so in its
    heartbeats, so a script's group restart leaves it alone)."""
    return int(_state.get("elastic_loops", 0)) > 0


def device() -> Any:
    """The torch.device this rank computes on: ``cuda:0`` (its one pinned
    GPU, CUDA or ROCm) or ``cpu``."""
    import torch

    backend = _state.get("backend", os.environ.get("MONARCH_NB_BACKEND", "cpu"))
    return torch.device("cuda", 0) if backend in ("cuda", "rocm") else torch.device("cpu")
