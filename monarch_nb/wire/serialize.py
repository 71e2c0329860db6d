"""Serialisation: cloudpickle with pickle-5 out-of-band buffers.

``dumps(obj)`` returns a list of frames: the pickle stream first, then one
frame per large buffer (NumPy arrays, CPU tensors, ``PickleBuffer``s) that the
pickle refers to out of band — those bytes are never copied into the pickle.
``loads(frames)`` rebuilds the object over those frames without copying them
again (zmq frames received with ``copy=False`` stay the backing memory).

Tensors travel as CPU memory: a CUDA tensor is copied to the host by the
sender and arrives on the CPU (the receiver moves it with ``.to(mnb.device())``).
The rank may not even share a device numbering with the kernel. With the
mesh's ``gpu_ipc`` on, gpuipc.py takes CUDA tensors instead (by IPC handle
between processes of one host) and they arrive on the receiver's GPU.

Non-goals: signing (protocol), sockets (transport). Only call :func:`loads`
on frames that the protocol layer has verified.
"""

from __future__ import annotations

import dis
import functools
import io
import linecache
import os
import pickle
import sys
import types
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import cloudpickle

from . import gpuipc

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
        if t.device.type == "cuda":  # ROCm's devices are "cuda" too
            routed = gpuipc.reduce(t)  # None unless this process sends by GPU IPC
            if routed is not None:
                return routed
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


# -- calls: the function travels in its own frame, so both sides can cache it --

_FROZEN = (type(None), bool, int, float, complex, str, bytes, types.ModuleType,
           types.BuiltinFunctionType)
_fn_cache: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], bytes]] = weakref.WeakKeyDictionary()


def dumps_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Frames of a call: ``[function pickle, *dumps((args, kwargs))]``.

    The function's pickle is reused from the previous call of the same
    function object when nothing it captures can have changed: its code,
    defaults, closure cells and referenced globals are the very same objects
    and all immutable (numbers, strings, modules, ...). A function that
    captures anything mutable (a model, a list) is pickled afresh every time,
    so ranks always see the current state. On two cores the saved
    ``cloudpickle.dumps`` is a visible share of a no-op call.
    """
    try:
        fingerprint = _fingerprint(fn)
        cached = _fn_cache.get(fn) if fingerprint is not None else None
        if cached is not None and cached[0] == fingerprint:
            fn_bytes = cached[1]
        else:
            sources, files = _sources(fn)
            fn_bytes = cloudpickle.dumps(_Sourced(fn, sources, files) if sources else fn,
                                         protocol=5)
            if fingerprint is not None:
                _fn_cache[fn] = (fingerprint, fn_bytes)
    except Exception as exc:
        raise SerializationError(_describe_failure((fn, args, kwargs), exc)) from None
    if not args and not kwargs:
        return [fn_bytes]
    try:
        rest = dumps((args, kwargs))
    except SerializationError:
        raise SerializationError(_describe_failure((fn, args, kwargs), Exception("not picklable"))) from None
    return [fn_bytes, *rest]


class _Sourced:
    """A function with the source of the cells it came from.

    Functions written in a notebook cell live in a file that exists only in
    the kernel (``/tmp/ipykernel_*/123.py``), and cloudpickle renames their
    code's file to ``<dynamic-code>``. Unpickled on a rank, this gives the
    code its file name back and registers the source in the rank's
    linecache, so tracebacks, stacks and the debugger show the cell's lines;
    then it is the plain function again."""

    def __init__(self, fn: Any, sources: dict[str, list[str]], files: dict[str, str]) -> None:
        self.fn, self.sources, self.files = fn, sources, files

    def __reduce__(self) -> tuple[Any, ...]:
        return (_register_source, (self.fn, self.sources, self.files))


def _register_source(fn: Any, sources: dict[str, list[str]], files: dict[str, str]) -> Any:
    for filename, lines in sources.items():
        if not os.path.exists(filename):
            linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)
    for name, filename in files.items():
        target = fn if not name else getattr(fn, "__globals__", {}).get(name)
        if isinstance(target, types.FunctionType):
            target.__code__ = _refile(target.__code__, filename)
    return fn


def _refile(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_refile(c, filename) if isinstance(c, types.CodeType) else c
                   for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _sources(fn: Any) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Source lines of ``fn``'s cell and of the functions it calls by name,
    for files the ranks cannot read (kernel cells, ``<...>`` names), and
    which function came from which file ("" is ``fn`` itself)."""
    code = getattr(fn, "__code__", None)
    if code is None or not isinstance(fn, types.FunctionType):
        return {}, {}
    files = {"": code.co_filename}
    glob = fn.__globals__
    for name in code.co_names:
        other = glob.get(name)
        if isinstance(other, types.FunctionType) and other.__module__ == fn.__module__:
            files[name] = other.__code__.co_filename
    sources: dict[str, list[str]] = {}
    for filename in set(files.values()):
        if filename.startswith("<frozen") or os.path.exists(filename):
            continue  # a real file: the rank reads it like any module
        lines = linecache.getlines(filename)
        if lines:
            sources[filename] = lines
    return sources, {k: v for k, v in files.items() if v in sources}


def _fingerprint(fn: Any) -> tuple[Any, ...] | None:
    """Identity of everything ``fn``'s pickle depends on, or None if any of
    it is mutable (then it must not be cached)."""
    if type(fn) is not types.FunctionType or fn.__dict__ or fn.__kwdefaults__:
        return None
    code = fn.__code__
    parts: list[Any] = [code, fn.__module__, fn.__qualname__]
    for value in fn.__defaults__ or ():
        if not isinstance(value, _FROZEN):
            return None
        parts.append(value)
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:
            return None
        if not isinstance(value, _FROZEN):
            return None
        parts.append(value)
    globs = fn.__globals__
    for name in _global_names(code):
        value = globs.get(name, _MISSING)
        if value is not _MISSING and not isinstance(value, _FROZEN):
            return None
        parts.append((name, id(value), value))
    return tuple(parts)


_MISSING = object()


@functools.lru_cache(maxsize=1024)  # per code object: asked on every call of a function
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return tuple(names)


class CallCache:
    """Rank side: unpickled functions by the bytes of their pickle (same
    bytes, same function). Functions that assign globals are not reused, so
    each call of those starts from the globals it was sent with."""

    def __init__(self, size: int = 128) -> None:
        self.size = size
        self._fns: OrderedDict[bytes, Any] = OrderedDict()

    def load(self, frames: Sequence[Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        if not frames:
            raise SerializationError("empty call payload")
        key = bytes(frames[0])
        fn = self._fns.get(key)
        if fn is None:
            fn = loads([key])
            if not _assigns_globals(getattr(fn, "__code__", None)):
                self._fns[key] = fn
                if len(self._fns) > self.size:
                    self._fns.popitem(last=False)
        else:
            self._fns.move_to_end(key)
        if len(frames) == 1:
            return fn, (), {}
        args, kwargs = loads(frames[1:])
        return fn, args, kwargs


def _assigns_globals(code: types.CodeType | None) -> bool:
    if code is None:
        return True
    for ins in dis.get_instructions(code):
        if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            return True
    return any(_assigns_globals(c) for c in code.co_consts if isinstance(c, types.CodeType))


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
