"""Training loops that survive a rank's death: ``mnb.elastic``.

Rank side::

    import monarch_nb as mnb
    state = mnb.elastic.State(model=model, optimizer=opt, step=0)

    @mnb.elastic.run(state)
    def train(state):
        ddp = DDP(model)            # build group-bound wrappers *inside*: the
        while state.step < 60:      # function is re-entered on each new group
            ...one step...
            state.step += 1
            state.commit()          # a consistent point to come back to

    train()                         # in a cell run with --elastic / elastic=True

When a member dies in the middle, the survivors' collective fails; each
survivor rolls back to its last ``commit()``, waits for the controller to
re-form the group (the dead rank is respawned), and then every member —
the respawned one included — takes the committed state of the most advanced
live peer over the new group (no disk) and re-enters the function. The
controller re-issues the elastic call on respawned processes, so the cell
completes when every rank has finished. A member lost during the
re-formation or the state transfer (two ranks lost at once come back one
backoff apart, each with a new generation) is handled the same way: wait for
the next group, take the state again.

The group grows back the same way, without breaking anything: while it is
smaller than the mesh (ranks lost, ``min_ranks``) and the controller starts
ranks again (a host given for lost ranks, a user's restart), each
``state.commit()`` inside the loop asks, in one small all_reduce among the
members, whether the REFORM for the larger group has reached any of them.
If so, every member leaves at that same commit, joins the larger group, the
ranks back take the committed state over it, and the function is
re-entered at full size. The same question is asked once when the function
returns, so a REFORM that came during the last steps still counts (the
function is then re-entered with the final state, at the larger size). At
full size a commit asks nothing: the check costs only while the group is
smaller than the mesh.

A survivor whose collective waits on *another survivor* (a ring) is released
when that survivor leaves its group (gloo closes a group's connections once
it is freed, which :func:`backends.leave_group` ensures). Should one still not
answer the re-formation within a few seconds, the controller replaces it; it
takes the state from a live peer like a respawned rank.

Determinism is the user's: with data chosen by step (and rank), the final
model equals that of a run without the fault. For *bitwise* equality with a
DDP model, keep DDP's bucket layout fixed (``find_unused_parameters=True``
turns off its re-bucketing after the first step; otherwise the wrapper rebuilt
after a fault sums gradients in another order and results agree only to
rounding).

Non-goals: when to respawn (policy), checkpoints on disk.
"""

from __future__ import annotations

import copy
import functools
import gc
import traceback
from collections.abc import Callable
from typing import Any

from .backends import JoinFailed
from .engine import context as _context
from .errors import MonarchError, is_peer_loss


class State:
    """What a training loop needs to resume: objects with ``state_dict()``
    (model, optimizer, scheduler...) and plain scalars (step, epoch, ...),
    which are attributes: ``state.step += 1``."""

    # set with object.__setattr__ in __init__ (attribute writes are the user's fields)
    _objects: dict[str, Any]
    _scalars: list[str]
    _snapshot: dict[str, Any]
    _grow: Callable[[], bool] | None
    commits: int

    def __init__(self, **items: Any) -> None:
        objects = {k: v for k, v in items.items() if hasattr(v, "state_dict")}
        scalars = {k: v for k, v in items.items() if k not in objects}
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_scalars", list(scalars))
        object.__setattr__(self, "_snapshot", None)
        object.__setattr__(self, "_grow", None)  # set by run() while its function runs
        object.__setattr__(self, "commits", 0)
        for k, v in {**scalars, **objects}.items():
            object.__setattr__(self, k, v)
        self.commit()

    def commit(self) -> None:
        """Remember the current state as the point to roll back to."""
        snap = {
            "objects": {k: copy.deepcopy(v.state_dict()) for k, v in self._objects.items()},
            "scalars": {k: copy.deepcopy(getattr(self, k)) for k in self._scalars},
            "commits": self.commits + 1,
        }
        object.__setattr__(self, "_snapshot", snap)
        object.__setattr__(self, "commits", snap["commits"])
        if self._grow is not None and self._grow():
            # the group grows back: every member leaves here, at this commit
            raise _Regroup()

    def rollback(self) -> None:
        """Return to the last commit."""
        self._load(self._snapshot)

    def _load(self, snap: dict[str, Any]) -> None:
        for k, sd in snap["objects"].items():
            self._objects[k].load_state_dict(copy.deepcopy(sd))
        for k, v in snap["scalars"].items():
            object.__setattr__(self, k, copy.deepcopy(v))
        object.__setattr__(self, "commits", snap["commits"])
        object.__setattr__(self, "_snapshot", snap)

    def __repr__(self) -> str:
        scalars = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._scalars)
        return f"State({', '.join(self._objects)}; {scalars}; commits={self.commits})"


def run(state: State, *, reform_timeout: float = 300.0,
        max_reforms: int = 100) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the wrapped ``fn(state, ...)`` survives membership changes.
    Call it as ``train()`` or, as Horovod's ``hvd.elastic.run`` has it,
    ``train(state)``: the state is passed once either way."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if args and args[0] is state:  # Horovod's habit: train(state)
                args = args[1:]
            # joined mid-call (respawned): first take the state of a live peer
            sync = _context._state.get("generation", 0) > _context._state.get("call_generation", 0)
            # while it runs, this rank carries on in place after a peer's
            # death (its heartbeats say so: a script's other ranks are
            # restarted, this one re-forms with the group)
            _context._state["elastic_loops"] = _context._state.get("elastic_loops", 0) + 1
            try:
                return _loop(fn, state, args, kwargs, sync, reform_timeout, max_reforms)
            finally:
                _context._state["elastic_loops"] -= 1

        return wrapper

    return decorate


def _loop(fn: Callable[..., Any], state: State, args: tuple[Any, ...], kwargs: dict[str, Any],
          sync: bool, reform_timeout: float, max_reforms: int) -> Any:
    """:func:`run`'s loop: ``fn`` until it returns or fails by itself."""
    reform = False
    reforms = 0
    while True:
        # Joining and syncing are retried like the loop itself: a
        # member may die during either (two ranks lost at once come
        # back one backoff apart, each with a new generation).
        try:
            if reform:
                _await_reform(reform_timeout)
                reform, sync = False, True
            if sync:
                _sync(state)
                sync = False
            object.__setattr__(state, "_grow", _grow_due)
            try:
                result = fn(state, *args, **kwargs)
            finally:
                object.__setattr__(state, "_grow", None)
            if not _grow_due():
                return result
            raise _Regroup()  # a REFORM came during the last steps
        except _Regroup as exc:
            # the commit just taken is the state: no rollback; the
            # frames of the old group's objects (DDP) are let go
            traceback.clear_frames(exc.__traceback__)
            gc.collect()
            reform = True
            continue
        except Exception as exc:
            retry = isinstance(exc, JoinFailed) or is_peer_loss(f"{type(exc).__name__} {exc}")
            if not retry or reforms >= max_reforms:
                raise
            # the failed attempt's frames hold group-bound objects (DDP)
            traceback.clear_frames(exc.__traceback__)
        reforms += 1
        gc.collect()
        state.rollback()
        reform = True


class _Regroup(BaseException):  # (not Exception: a loop's own `except Exception` must not swallow it)
    """The group grows back: leave it at this commit and join the larger one
    (raised by State.commit inside run(), caught there)."""


def _grow_due() -> bool:
    """While the group is smaller than the mesh: did the REFORM of a larger
    group reach any member? Asked of all of them at once (one all_reduce),
    so that all leave at the same commit; at full size, False at no cost."""
    state = _context._state
    waiting = state.get("reform_waiting")
    if waiting is None or int(state.get("world_size", 0)) >= int(state.get("mesh_size", 0)):
        return False
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    flag = torch.tensor([1 if waiting() else 0], device=_context.device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _await_reform(timeout: float) -> int:
    try:
        await_reform = _context._get("await_reform")
    except MonarchError:
        raise MonarchError("mnb.elastic needs a rank started by monarch_nb (the controller "
                           "re-forms the group)") from None
    return int(await_reform(timeout))


def _sync(state: State) -> None:
    """Every member takes the committed state of the most advanced live
    member (a replaced process has committed nothing of its own yet)."""
    import torch.distributed as dist

    fresh = _context.incarnation() > 0 and state.commits <= 1
    mine = (-1 if fresh else state.commits, dist.get_rank())
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    src = max(everyone, key=lambda item: (item[0], -item[1]))[1]
    box: list[Any] = [state._snapshot if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    state._load(box[0])
