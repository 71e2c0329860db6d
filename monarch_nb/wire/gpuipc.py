"""CUDA/ROCm tensors between processes of one host by IPC handle (opt-in).

Off by default (``MeshConfig.gpu_ipc``); then serialize.py copies a CUDA
tensor to the host and it arrives on the CPU, as it always did. On, a CUDA
tensor (ROCm's too: torch calls HIP devices "cuda") in call arguments,
pushed values and results takes one of two routes, chosen by the sender:

* **ipc** (at least ``IPC_MIN`` bytes, and every receiver sees the GPU): a
  snapshot clone on the sender's GPU, shared with torch's own reduction
  (``torch.multiprocessing.reductions.reduce_tensor``: a cudaIpcMemHandle of
  the clone's allocation, its offset, an interprocess event after the
  clone). The receiver opens it with ``rebuild_cuda_tensor`` on its index
  for the same physical GPU (matched by UUID), clones it into memory of its
  own, waits for that copy and closes the handle, all inside unpickling.
* **host** (small tensors, or receivers that cannot see the GPU): bytes as
  for a CPU tensor (serialize's path: out-of-band frames, shared memory),
  marked to be put back on a GPU: the receiver's index for the sender's GPU
  if it sees it, else its current device.

Either way each receiver gets an independent tensor on a GPU, holding the
values the sender's tensor had when it was sent: what a pickled copy is.

Lifetime. One payload is signed once and sent to every rank of a call, but
torch's counter (CudaIPCSentData) counts one consumer per share: N ranks
opening one share would run it below zero (an unsigned count: the block
then stays in torch's limbo for ever). So receivers are given a counter
name that does not exist (torch's release is best effort and ignores it)
and the *sender* owns the count: it holds the clone and its one count in
:data:`_shares` until every receiver is done, then :func:`release` drops
the count and the clone, and the allocator gets the block back at once.
"Done" is the end of the call for the controller's shares
(controller/calls/dataplane.py) and the controller's ``RELEASE`` for a rank's
result, sent once the controller has copied it (controller/core.py). A
receiver that dies holding a mapping loses it with its process.

Trust: a handle is only read from a verified message (it is in the signed
pickle), from a peer of this mesh on this host; it grants the snapshot's
allocation only, never the sender's live tensor. See docs/gpu-dataplane.md.

Non-goals: pickling anything but CUDA tensors (serialize.py), deciding who
may use it (the controller: local ranks, GPU backends), collectives.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import secrets
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

IPC_MIN = 1 << 20  # smaller tensors go by bytes: opening a handle costs more than the copy
ROUTE_IPC = "ipc"
ROUTE_HOST = "host"
# rebuild_cuda_tensor's arguments that the receiver replaces (torch 2.x order)
_ARG_CLS, _ARG_DEVICE, _ARG_GRAD, _ARG_COUNTER, _ARG_COUNTER_OFFSET = 0, 6, 10, 11, 12
_N_ARGS = 15
# A shared-memory name nobody creates: torch's release of a received
# storage opens it, fails and moves on (best effort by design), so a
# receiver never touches the sender's count. See the module docstring.
_NO_COUNTER = b"/monarch-nb-gpuipc-no-counter"
_MODULE_NAME = __name__.encode()
log = logging.getLogger(__name__)


@dataclass
class _Share:
    snapshot: Any  # the clone the handle names; alive until released
    counter: bytes  # torch's ref-counter file and slot for this share
    offset: int
    device: int


_lock = threading.Lock()
_shares: dict[str, _Share] = {}  # by token: shares sent and not yet released
_local = threading.local()  # .pending: tokens made by this thread, not yet claimed
_process_on = False  # a rank of a mesh with gpu_ipc on (configure)
_noticed = False


class _Scope:
    """Where the sender's tensors may go by handle: ``openable`` are the
    sender's device indices every receiver can open (None: any)."""

    __slots__ = ("openable",)

    def __init__(self, openable: frozenset[int] | None) -> None:
        self.openable = openable


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("mnb_gpuipc_scope",
                                                                       default=None)
_consumed: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "mnb_gpuipc_consumed", default=None)


# -- who decides ------------------------------------------------------------------------------
def effective(requested: bool, backend: str, remote: bool,
              cuda_available: Any = None) -> tuple[bool, str | None]:
    """Whether a mesh asked for ``gpu_ipc`` gets it, and if not, the one-line
    notice saying why (it is an optimisation: never an error)."""
    if not requested:
        return False, None
    if backend not in ("cuda", "rocm"):
        return False, (f"monarch_nb: gpu_ipc is on but this mesh has no GPU (backend {backend}); "
                       "tensors travel as before")
    if remote:
        return False, ("monarch_nb: gpu_ipc is on but the ranks are on other hosts (IPC handles "
                       "only work on one host); tensors travel as before")
    check = cuda_available or _cuda_available
    if not check():
        return False, ("monarch_nb: gpu_ipc is on but torch.cuda is not available here; "
                       "tensors travel as before")
    return True, None


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def configure(enabled: bool) -> None:
    """A rank: send CUDA results by handle to the controller (which sees
    every GPU of the host) from now on."""
    global _process_on
    _process_on = bool(enabled)


def enabled() -> bool:
    return _process_on


@contextlib.contextmanager
def sending(receiver_devices: Sequence[int]) -> Iterator[None]:
    """The controller: serialise a payload for receivers each on one GPU,
    given by its index in this process (a rank sees only its own GPU, so a
    handle is opened only if every receiver is on the tensor's GPU)."""
    devices = set(receiver_devices)
    token = _scope.set(_Scope(frozenset(devices) if len(devices) == 1 else frozenset()))
    try:
        yield
    finally:
        _scope.reset(token)


def route(nbytes: int, device: int, openable: frozenset[int] | None) -> str:
    """``ipc`` or ``host`` for a CUDA tensor of ``nbytes`` on ``device``."""
    if nbytes < IPC_MIN:
        return ROUTE_HOST
    if openable is not None and device not in openable:
        return ROUTE_HOST
    return ROUTE_IPC


def _current_scope() -> _Scope | None:
    scope = _scope.get()
    if scope is None and _process_on:
        return _ANY
    return scope


_ANY = _Scope(None)


# -- the sender ----------------------------------------------------------------------------
def reduce(t: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """serialize's hook for a CUDA tensor: its reduction, or None when this
    process is not sending by GPU IPC (serialize copies it to the host)."""
    scope = _current_scope()
    if scope is None:
        return None
    import torch

    data = t.detach()
    index = data.device.index if data.device.index is not None else torch.cuda.current_device()
    ident = device_ident(index)
    param = type(t) is not torch.Tensor
    nbytes = data.numel() * data.element_size()
    if ident is not None and route(nbytes, index, scope.openable) == ROUTE_IPC:
        try:
            tok, args = _share(data)
        except Exception as exc:  # torch's reduction refused (an old torch, no IPC)
            _notice(f"monarch_nb: gpu_ipc: cannot share a CUDA tensor by handle "
                    f"({type(exc).__name__}: {str(exc)[:120]}); sending it by bytes")
        else:
            return (_open, (tok, ident, args, bool(t.requires_grad), param))
    return (_restore, (data.cpu(), ident, bool(t.requires_grad), param))


def _share(data: Any) -> tuple[str, tuple[Any, ...]]:
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    # A clone: the snapshot a pickled copy would be (later writes to the
    # sender's tensor are not seen), its own allocation (a handle grants
    # the whole cudaMalloc block it lies in), and shareable even when
    # ``data`` was itself received by IPC (torch refuses to re-share that).
    snapshot = data.clone(memory_format=torch.contiguous_format)
    fn, args = reduce_tensor(snapshot)
    if fn is not rebuild_cuda_tensor or len(args) != _N_ARGS:
        raise RuntimeError("torch's CUDA tensor reduction is not the one this version knows")
    tok = secrets.token_hex(8)
    with _lock:
        _shares[tok] = _Share(snapshot, bytes(args[_ARG_COUNTER]), int(args[_ARG_COUNTER_OFFSET]),
                              int(args[_ARG_DEVICE]))
    _pending().append(tok)
    return tok, tuple(args)


def _pending() -> list[str]:
    pending: list[str] | None = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = []
    return pending


def claim() -> list[str]:
    """The tokens of the shares this thread made since the last claim (a
    payload that is about to be sent): its caller releases them when the
    receivers are done."""
    pending = _pending()
    out = list(pending)
    pending.clear()
    return out


def release_pending() -> None:
    """The payload this thread was making will not be sent (it failed, or
    was refused): release its shares now."""
    for tok in claim():
        release(tok)


def release(tok: str) -> bool:
    """Every receiver of share ``tok`` is done: give back torch's count and
    the snapshot. False for a token this process does not hold."""
    with _lock:
        share = _shares.pop(tok, None)
    if share is None:
        return False
    import torch

    # The count first: when the snapshot then goes, torch sees no consumer
    # left and frees the block (instead of parking it in its limbo).
    try:
        torch.UntypedStorage._release_ipc_counter(share.counter, share.offset,
                                                  device=share.device)
    except Exception as exc:  # then torch keeps the block in its limbo: say so
        log.warning("monarch_nb: gpu_ipc: could not release a share's count (%s: %s); "
                    "its GPU memory stays held until this process exits", type(exc).__name__, exc)
    del share
    return True


def release_all() -> None:
    with _lock:
        toks = list(_shares)
    for tok in toks:
        release(tok)


def outstanding() -> int:
    """Shares sent and not released (the GPU check reads it)."""
    with _lock:
        return len(_shares)


# -- the receiver --------------------------------------------------------------------------
@contextlib.contextmanager
def consuming() -> Iterator[list[str]]:
    """Collect the tokens of the shares opened while unpickling in this
    block (the controller tells their rank to release them)."""
    toks: list[str] = []
    token = _consumed.set(toks)
    try:
        yield toks
    finally:
        _consumed.reset(token)


def mentioned(frames: Iterable[Any]) -> bool:
    """Whether a payload may hold shares (a result dropped unread must be
    opened anyway, so its rank can release them)."""
    for f in frames:
        view = memoryview(f)
        if view.nbytes < IPC_MIN and _MODULE_NAME in view.tobytes():
            return True
    return False


def _open(tok: str, ident: str, args: tuple[Any, ...], requires_grad: bool, param: bool) -> Any:
    index = local_index(ident)
    if index is None:
        seen = os.environ.get("CUDA_VISIBLE_DEVICES", os.environ.get("HIP_VISIBLE_DEVICES", "all"))
        raise RuntimeError(
            f"a CUDA tensor came by IPC handle from GPU {ident}, which this process does not "
            f"see (visible devices: {seen or 'none'}); start the mesh without gpu_ipc")
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    fixed = list(args)
    fixed[_ARG_CLS] = torch.Tensor
    fixed[_ARG_DEVICE] = index
    fixed[_ARG_GRAD] = False
    fixed[_ARG_COUNTER] = _NO_COUNTER
    fixed[_ARG_COUNTER_OFFSET] = 0
    shared = rebuild_cuda_tensor(*fixed)  # waits (on this stream) for the sender's clone
    with torch.cuda.device(index):
        out = shared.clone()
        # the copy must be over before the handle closes and before this
        # process answers: then the sender may free the snapshot
        torch.cuda.current_stream(index).synchronize()
    del shared  # closes the handle (torch's cache holds it weakly)
    toks = _consumed.get()
    if toks is not None:
        toks.append(tok)
    return _finish(out, requires_grad, param)


def _restore(cpu: Any, ident: str | None, requires_grad: bool, param: bool) -> Any:
    """A CUDA tensor that came by bytes: back on this process's GPU."""
    index = local_index(ident) if ident is not None else None
    if index is None and _cuda_available():
        import torch

        index = torch.cuda.current_device()
    out = cpu if index is None else cpu.to(f"cuda:{index}")
    return _finish(out, requires_grad, param)


def _finish(t: Any, requires_grad: bool, param: bool) -> Any:
    import torch

    if param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


# -- which GPU is which ----------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def device_ident(index: int) -> str | None:
    """The physical identity of this process's GPU ``index`` (its UUID,
    else its PCI address): the same in every process of the host, whatever
    CUDA_VISIBLE_DEVICES numbers it as."""
    try:
        import torch

        props = torch.cuda.get_device_properties(index)
    except Exception:
        return None
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        return uuid
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        return (f"pci:{getattr(props, 'pci_domain_id', 0)}:{bus}:"
                f"{getattr(props, 'pci_device_id', 0)}")
    return None


def local_index(ident: str | None) -> int | None:
    """This process's index of the GPU named ``ident``, or None."""
    if ident is None or not _cuda_available():
        return None
    import torch

    for i in range(torch.cuda.device_count()):
        if device_ident(i) == ident:
            return i
    return None


def _notice(line: str) -> None:
    global _noticed
    with _lock:
        if _noticed:
            return
        _noticed = True
    print(line, file=sys.stderr)


__all__ = ["IPC_MIN", "claim", "configure", "consuming", "effective", "enabled", "mentioned",
           "outstanding", "reduce", "release", "release_all", "release_pending", "route",
           "sending"]
