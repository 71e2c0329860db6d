"""The user's own torch.distributed group calls, on a rank that already has one.

A rank joins the mesh's group before its first cell or script (the worker
does, so that respawn can re-form it). Code written for torchrun calls
``dist.init_process_group(...)`` first thing and ``destroy_process_group()``
last; here, in cells and launched scripts alike:

* ``init_process_group(...)`` returns at once and keeps the mesh's group
  (no "trying to initialize the default process group twice!"). What it
  asked for is honoured where it can be and said where it cannot:
  ``"nccl"`` on a machine without CUDA raises as torch would (never a
  silent gloo); ``timeout=`` is applied to the mesh's group (and again to
  each group re-formed after a death); a different ``init_method``, or a
  backend other than the mesh's, prints that the mesh's group is used;
* ``destroy_process_group()`` of the default group is a no-op: the group
  belongs to the mesh, which re-forms it after a death. In a cell it prints
  a notice; a script (which calls it at its very end) stays quiet.

monarch_nb's own calls (the worker joining a new generation, leave_group)
reach torch unchanged: they are told apart by the caller's file.

Non-goals: forming the group (backends.init_group), re-forming it (worker).
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

# where monarch_nb's own code lives: calls from there reach torch unchanged
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_state: dict[str, Any] = {"installed": False, "quiet_destroy": 0, "timeout": None}


def _ours(depth: int = 2) -> bool:
    frame = sys._getframe(depth)
    return os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE)


def _say(text: str) -> None:
    """A notice on the rank's stderr (the cell's or the launcher's output)."""
    sys.stderr.write(f"monarch_nb: {text}\n")


def _requested(backend: Any) -> set[str]:
    """Backend names of ``"nccl"``, ``"cpu:gloo,cuda:nccl"``, ``Backend.NCCL``."""
    if backend is None:
        return set()
    names = set()
    for part in str(backend).lower().split(","):
        names.add(part.split(":")[-1].strip())
    return names - {""}


def check_backend(dist: Any, backend: Any) -> None:
    """Raise as torch would for a backend this machine cannot run."""
    if "nccl" not in _requested(backend):
        return
    if not dist.is_nccl_available():
        raise RuntimeError("Distributed package doesn't have NCCL built in")
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("ProcessGroupNCCL is only supported with GPUs, no GPUs found!")


def _mesh_backend(dist: Any) -> str:
    try:
        return str(dist.get_backend()).lower()
    except Exception:
        return ""


def _apply_timeout(dist: Any, timeout: Any) -> None:
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        _say(f"timeout={timeout} cannot be applied to the mesh's group with this torch; "
             "it keeps its own")
        return
    try:
        setter(timeout)
    except Exception as exc:  # a backend without a settable timeout
        _say(f"timeout={timeout} could not be applied to the mesh's group ({exc})")


def install() -> None:
    """Replace ``init_process_group`` / ``destroy_process_group`` in
    ``torch.distributed`` for the rest of this process (idempotent)."""
    if _state["installed"]:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group

    def init_process_group(backend: Any = None, init_method: str | None = None,
                           timeout: datetime.timedelta | None = None, world_size: int = -1,
                           rank: int = -1, *args: Any, **kwargs: Any) -> None:
        if _ours() or not dist.is_initialized():
            real_init(backend, init_method, timeout, world_size, rank, *args, **kwargs)
            if _ours() and _state["timeout"] is not None:
                _apply_timeout(dist, _state["timeout"])  # a re-formed group keeps the user's
            return None
        check_backend(dist, backend)
        mine = _mesh_backend(dist)
        wanted = _requested(backend)
        if wanted and mine and not wanted <= _requested(mine):
            _say(f"init_process_group({str(backend)!r}): the mesh's group ({mine}) is kept"
                 + ("; for CPU tensors make a gloo group: dist.new_group(backend='gloo')"
                    if mine == "nccl" else ""))
        if init_method not in (None, "env://"):
            _say(f"init_method={init_method!r} is not used: the mesh's group (formed by "
                 "monarch_nb, re-formed after a death) is")
        size, me = dist.get_world_size(), dist.get_rank()
        if (world_size not in (-1, None) and world_size != size) or (rank not in (-1, None)
                                                                     and rank != me):
            _say(f"init_process_group(world_size={world_size}, rank={rank}): this rank "
                 f"is {me} of {size} in the mesh's group")
        if timeout is not None:
            _state["timeout"] = timeout
            _apply_timeout(dist, timeout)
        return None

    def destroy_process_group(group: Any = None) -> None:
        if (group is None or group is dist.group.WORLD) and not _ours():
            if not _state["quiet_destroy"]:
                _say("destroy_process_group() left the mesh's group in place (the mesh "
                     "owns it; %monarch restart all re-forms it)")
            return None
        return real_destroy(group)

    init_process_group.__wrapped__ = real_init  # type: ignore[attr-defined]
    destroy_process_group.__wrapped__ = real_destroy  # type: ignore[attr-defined]
    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
    _state["installed"] = True


class quiet_destroy:
    """While a script runs: its closing ``destroy_process_group()`` says nothing."""

    def __enter__(self) -> None:
        _state["quiet_destroy"] += 1

    def __exit__(self, *exc: Any) -> None:
        _state["quiet_destroy"] -= 1


__all__ = ["check_backend", "install", "quiet_destroy"]
