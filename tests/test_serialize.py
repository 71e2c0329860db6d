"""Unit tests for monarch_nb.wire.serialize: cloudpickle with out-of-band buffers."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch

from monarch_nb.wire.serialize import OOB_THRESHOLD, SerializationError, dumps, loads


def roundtrip(obj):
    return loads(dumps(obj))


def as_bytes(frames):
    return [bytes(memoryview(f)) for f in frames]


def frame_size(frame) -> int:
    return memoryview(frame).nbytes


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(b) is type(a)
    assert b.dtype == a.dtype
    assert b.shape == a.shape
    assert b.device.type == "cpu"
    assert b.requires_grad == a.requires_grad
    assert torch.equal(a.detach(), b.detach())


# -- functions ----------------------------------------------------------------

def test_lambda_with_closure():
    k = 3
    f = lambda x: x + k  # noqa: E731 (a lambda is the point)
    assert roundtrip(f)(2) == 5


def test_nested_closures_and_local_class():
    def make(scale):
        class Acc:
            def __init__(self):
                self.total = 0

            def add(self, v):
                self.total += v * scale
                return self.total

        def run(values):
            acc = Acc()
            for v in values:
                acc.add(v)
            return acc.total

        return run

    assert roundtrip(make(10))([1, 2, 3]) == 60


def test_call_triple():
    def fn(a, b=0, *, c=1):
        return (a + b) * c

    f, args, kwargs = roundtrip((fn, (2,), {"b": 3, "c": 4}))
    assert f(*args, **kwargs) == 20


def test_plain_values():
    value = {"a": [1, 2.5, "x", None, b"bytes"], ("t",): {1, 2}, "big": b"z" * (OOB_THRESHOLD * 2)}
    assert roundtrip(value) == value


def test_frames_are_buffers():
    frames = dumps({"x": 1})
    assert len(frames) == 1
    memoryview(frames[0])  # buffer protocol


# -- numpy ----------------------------------------------------------------------

def test_small_numpy_array_in_band():
    a = np.arange(10, dtype=np.float32)
    frames = dumps(a)
    assert len(frames) == 1
    np.testing.assert_array_equal(loads(frames), a)


def test_large_numpy_array_out_of_band():
    a = np.arange(1_000_000, dtype=np.float64)  # 8 MB
    frames = dumps(a)
    assert len(frames) > 1
    assert frame_size(frames[0]) < 1024  # the pickle does not carry the data
    assert sum(frame_size(f) for f in frames[1:]) == a.nbytes
    b = loads(frames)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(b, a)


def test_numpy_threshold_boundary():
    below = np.zeros(OOB_THRESHOLD - 1, dtype=np.uint8)
    at = np.zeros(OOB_THRESHOLD, dtype=np.uint8)
    assert len(dumps(below)) == 1
    assert len(dumps(at)) == 2


def test_numpy_multidim_and_dtypes():
    for a in (np.ones((300, 300), dtype=np.int16), np.arange(20_000, dtype=np.complex64).reshape(100, 200),
              np.array([True, False] * 50_000), np.zeros((0, 5))):
        b = roundtrip(a)
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(b, a)


def test_numpy_non_contiguous():
    a = np.arange(400_000, dtype=np.float32).reshape(400, 1000)[:, ::3]
    np.testing.assert_array_equal(roundtrip(a), a)


# -- torch --------------------------------------------------------------------

TENSORS = {
    "float32": lambda: torch.randn(3, 4),
    "bfloat16": lambda: torch.randn(5, 7).to(torch.bfloat16),
    "float16": lambda: torch.randn(9).half(),
    "float64": lambda: torch.randn(2, 2, dtype=torch.float64),
    "int64": lambda: torch.arange(-5, 5, dtype=torch.int64),
    "int8": lambda: torch.tensor([-128, 0, 127], dtype=torch.int8),
    "uint8": lambda: torch.tensor([0, 255], dtype=torch.uint8),
    "bool": lambda: torch.tensor([True, False, True]),
    "complex64": lambda: torch.randn(4, dtype=torch.complex64),
    "non-contiguous": lambda: torch.arange(12.0).reshape(3, 4).t(),
    "strided-slice": lambda: torch.arange(100.0)[10:50:3],
    "storage-offset": lambda: torch.arange(20, dtype=torch.int64)[7:],
    "requires_grad": lambda: torch.randn(3, requires_grad=True),
    "empty": lambda: torch.empty(0),
    "empty-2d": lambda: torch.empty(0, 3, dtype=torch.bfloat16),
    "large-float32": lambda: torch.randn(512, 512),
    "large-bfloat16": lambda: torch.randn(300, 300).to(torch.bfloat16),
    "large-int64": lambda: torch.arange(100_000, dtype=torch.int64),
    "large-non-contiguous": lambda: torch.randn(400, 300).t(),
    "large-requires_grad": lambda: torch.randn(200, 200, requires_grad=True),
}


@pytest.mark.parametrize("make", TENSORS.values(), ids=TENSORS.keys())
def test_tensor_round_trip(make):
    t = make()
    same_tensor(t, roundtrip(t))


@pytest.mark.parametrize("make", TENSORS.values(), ids=TENSORS.keys())
def test_tensor_round_trip_over_read_only_bytes(make):
    t = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable tensor" warning
        u = loads(as_bytes(dumps(t)))
    same_tensor(t, u)
    if u.numel():
        with torch.no_grad():
            u.view(-1)[0] = u.view(-1)[-1]  # writable: the read-only frame was copied


@pytest.mark.parametrize("make", [lambda: torch.tensor(3.5), lambda: torch.tensor(7),
                                  lambda: torch.tensor(1.0, requires_grad=True).sum()],
                         ids=["float32", "int64", "loss-like"])
def test_zero_dim_tensor(make):
    t = make()
    u = roundtrip(t)
    assert u.shape == () and u.dtype == t.dtype and u.item() == t.item()


def test_zero_dim_bool_and_uint8_tensor():
    # one-byte dtypes need no element-size change, so they already work
    for t in (torch.tensor(True), torch.tensor(200, dtype=torch.uint8)):
        same_tensor(t, roundtrip(t))


def test_requires_grad_tensor_is_a_fresh_leaf():
    t = torch.randn(4, requires_grad=True) * 2  # non-leaf
    u = roundtrip(t)
    assert u.requires_grad and u.is_leaf and u.grad_fn is None
    u.sum().backward()
    assert torch.equal(u.grad, torch.ones(4))


@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("shape", [(3, 2), (300, 300)])
def test_parameter(requires_grad, shape):
    p = torch.nn.Parameter(torch.randn(*shape), requires_grad=requires_grad)
    q = roundtrip(p)
    assert type(q) is torch.nn.Parameter
    assert q.requires_grad is requires_grad
    assert torch.equal(q.detach(), p.detach())


def test_module_state_dict_and_module():
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
    sd = roundtrip(model.state_dict())
    assert sd.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        same_tensor(v, sd[k])
    clone = roundtrip(model)
    x = torch.randn(3, 256)
    assert torch.equal(clone(x), model(x))


def test_large_tensor_out_of_band():
    t = torch.randn(1024, 1024)  # 4 MB
    frames = dumps(t)
    assert len(frames) == 2
    assert frame_size(frames[0]) < 1024
    assert frame_size(frames[1]) == t.numel() * t.element_size()
    same_tensor(t, loads(frames))


def test_small_tensor_in_band():
    t = torch.randn(16)
    frames = dumps(t)
    assert len(frames) == 1


def test_nested_containers_of_tensors():
    big = [torch.randn(256, 256) for _ in range(3)]  # 256 KB each
    obj = {
        "params": big[:2],
        "nested": ({"deep": [big[2], torch.arange(5)]},),
        "array": np.arange(50_000, dtype=np.float64),
        "scalar": 1.5,
    }
    frames = dumps(obj)
    assert len(frames) == 1 + 4  # one frame per large buffer
    assert frame_size(frames[0]) < 4096
    out = loads(as_bytes(frames))
    for a, b in zip(obj["params"], out["params"], strict=True):
        same_tensor(a, b)
    same_tensor(big[2], out["nested"][0]["deep"][0])
    same_tensor(torch.arange(5), out["nested"][0]["deep"][1])
    np.testing.assert_array_equal(out["array"], obj["array"])
    assert out["scalar"] == 1.5


def test_loads_over_writable_frames_does_not_copy():
    t = torch.zeros(128 * 1024, dtype=torch.uint8)
    frames = dumps(t)
    buf = bytearray(memoryview(frames[1]))
    u = loads([bytes(memoryview(frames[0])), buf])
    buf[0] = 42  # the tensor is backed by the received frame
    assert u[0].item() == 42


def test_loads_over_read_only_numpy():
    a = np.arange(100_000, dtype=np.int32)
    b = loads(as_bytes(dumps(a)))
    np.testing.assert_array_equal(a, b)


def test_loads_accepts_memoryview_frames():
    t = torch.randn(300, 300)
    same_tensor(t, loads([memoryview(bytes(memoryview(f))) for f in dumps(t)]))


# -- errors -------------------------------------------------------------------

def test_error_names_positional_argument():
    def fn(x):
        return x

    with pytest.raises(SerializationError) as info:
        dumps((fn, (1, threading.Lock()), {}))
    msg = str(info.value)
    assert "argument 1 (lock)" in msg
    assert "cannot be sent to the ranks" in msg


def test_error_names_first_argument():
    with pytest.raises(SerializationError, match=r"argument 0 \(lock\)"):
        dumps((print, (threading.Lock(),), {}))


def test_error_names_keyword_argument():
    with pytest.raises(SerializationError) as info:
        dumps((print, (1, 2), {"ok": 3, "guard": threading.Lock()}))
    assert "argument guard= (lock)" in str(info.value)


def test_error_names_function_when_arguments_are_fine():
    lock = threading.Lock()

    def uses_lock():
        with lock:
            return 1

    with pytest.raises(SerializationError) as info:
        dumps((uses_lock, (), {}))
    assert "function" in str(info.value) and "uses_lock" in str(info.value)


def test_error_for_other_objects():
    with pytest.raises(SerializationError) as info:
        dumps({"lock": threading.Lock()})
    assert "dict cannot be serialised" in str(info.value)


@pytest.mark.parametrize("frames", [
    [b"not a pickle"],
    [b""],
    [b"\x80\x05garbage"],
    [memoryview(b"\x00\x01\x02")],
])
def test_loads_garbage(frames):
    with pytest.raises(SerializationError, match="could not deserialise"):
        loads(frames)


def test_loads_empty():
    with pytest.raises(SerializationError, match="empty payload"):
        loads([])


def test_loads_missing_out_of_band_frame():
    frames = dumps(np.zeros(OOB_THRESHOLD * 2, dtype=np.uint8))
    with pytest.raises(SerializationError):
        loads(frames[:1])


def test_loads_truncated_pickle():
    frames = as_bytes(dumps({"a": list(range(100))}))
    with pytest.raises(SerializationError):
        loads([frames[0][: len(frames[0]) // 2]])
