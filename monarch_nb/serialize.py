"""Serialisation: cloudpickle with pickle-5 out-of-band buffers.

``dumps(obj)`` returns a list of frames: the pickle stream first, then one
frame per large buffer (NumPy arrays, CPU tensors, ``PickleBuffer``s) that the
pickle refers to out of band — those bytes are never copied into the pickle.
``loads(frames)`` rebuilds the object over those frames without copying them
again (zmq frames received with ``copy=False`` stay the backing memory).

Tensors travel as CPU memory: a CUDA tensor is copied to the host by the
sender and arrives on the CPU (the receiver moves it with ``.to(mnb.device())``).
The rank may not even share a device numbering with the kernel.

Non-goals: signing (protocol), sockets (transport). Only call :func:`loads`
on frames that the protocol layer has verified.
"""

from __future__ import annotations

import io
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import cloudpickle

# Buffers smaller than this go inline: a frame has a fixed cost that only pays
# off for big arrays.
OOB_THRESHOLD = 64 * 1024


class SerializationError(Exception):
    """An object could not be (de)serialised; the message says which one."""


def _rebuild_tensor(buf: Any, dtype_name: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    import numpy as np
    import torch

    dtype = getattr(torch, dtype_name)
    raw = memoryview(buf).cast("B")
    if len(raw) == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        # frombuffer shares memory with the received frame: no copy. Frames are
        # read-only, torch warns about that, and the tensor is writable only if
        # the frame is; copy then (rare: results are usually read, not mutated).
        arr = np.frombuffer(raw, dtype=np.uint8)
        if not arr.flags.writeable:
            arr = arr.copy()
        t = torch.from_numpy(arr).view(dtype).reshape(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) in (torch.Tensor, torch.nn.Parameter):
            return self._reduce_tensor(obj)
        return super().reducer_override(obj)

    @staticmethod
    def _reduce_tensor(t: Any) -> Any:
        import torch

        if t.is_sparse or t.layout != torch.strided or t.is_quantized:
            return NotImplemented
        data = t.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous()
        nbytes = data.numel() * data.element_size()
        shape = tuple(data.shape)
        dtype_name = str(data.dtype).removeprefix("torch.")
        if nbytes < OOB_THRESHOLD:
            payload: Any = bytes(data.reshape(-1).view(torch.uint8).numpy()) if nbytes else b""
        else:
            payload = pickle.PickleBuffer(data.reshape(-1).view(torch.uint8).numpy())
        if type(t) is not torch.Tensor:  # Parameter: rebuild as Parameter
            return (_rebuild_parameter, (payload, dtype_name, shape, t.requires_grad))
        return (_rebuild_tensor, (payload, dtype_name, shape, t.requires_grad))


def _rebuild_parameter(buf: Any, dtype_name: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    return torch.nn.Parameter(_rebuild_tensor(buf, dtype_name, shape, False), requires_grad=requires_grad)


def dumps(obj: Any) -> list[Any]:
    """Serialise ``obj`` into ``[pickle, *out_of_band_buffers]``."""
    buffers: list[pickle.PickleBuffer] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < OOB_THRESHOLD:
            return True  # serialise in band
        buffers.append(buf)
        return False

    out = io.BytesIO()
    try:
        _Pickler(out, protocol=5, buffer_callback=keep).dump(obj)
    except Exception as exc:
        raise SerializationError(_describe_failure(obj, exc)) from None
    return [out.getbuffer(), *(b.raw() for b in buffers)]


def loads(frames: Sequence[Any]) -> Any:
    """Inverse of :func:`dumps`; ``frames`` must already be verified."""
    if not frames:
        raise SerializationError("empty payload")
    try:
        return pickle.loads(frames[0], buffers=[memoryview(f) for f in frames[1:]])
    except Exception as exc:
        raise SerializationError(f"could not deserialise: {type(exc).__name__}: {exc}") from None


def _describe_failure(obj: Any, exc: Exception) -> str:
    what = type(obj).__name__
    if isinstance(obj, tuple) and len(obj) == 3 and callable(obj[0]):
        # (fn, args, kwargs): say which argument is the culprit
        fn, args, kwargs = obj
        for i, arg in enumerate(args):
            if not _picklable(arg):
                return f"argument {i} ({type(arg).__name__}) cannot be sent to the ranks: {exc}"
        for name, arg in kwargs.items():
            if not _picklable(arg):
                return f"argument {name}= ({type(arg).__name__}) cannot be sent to the ranks: {exc}"
        return f"function {getattr(fn, '__qualname__', fn)!r} cannot be sent to the ranks: {exc}"
    return f"{what} cannot be serialised: {type(exc).__name__}: {exc}"


def _picklable(obj: Any) -> bool:
    try:
        _Pickler(io.BytesIO(), protocol=5, buffer_callback=lambda b: False).dump(obj)
        return True
    except Exception:
        return False
