"""GPU IPC data plane (wire/gpuipc.py), the parts a CPU machine can check.

What is checked here: the flag (MeshConfig.gpu_ipc, the ranks'
MONARCH_NB_GPU_IPC, never inherited from the kernel's environment, never
given to remote ranks); the one-line notice and fallback when there is no
GPU (also on a real CPU mesh); the sender's choice of route (by size and by
which GPU the receivers see); that serialize only asks gpuipc about CUDA
tensors (the CPU path's frames are byte for byte the same with the flag
on); what a receiver without the sender's GPU does; and that shares are
held until released, by the call (dataplane) or on request, and only once.

What needs a GPU (opening a handle in another process, copy semantics,
GB/s, no leak) is in scripts/gpu_check.py and in the one test at the end,
skipped without CUDA.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from monarch_nb import Mesh, backends
from monarch_nb.config import ENV_CONTROLLER, ENV_GPU_IPC, MeshConfig, RankEnv
from monarch_nb.controller.calls.dataplane import DataPlane
from monarch_nb.errors import UsageError
from monarch_nb.procs.launchers import SshLauncher
from monarch_nb.procs.supervisor import Supervisor
from monarch_nb.wire import gpuipc, serialize

MiB = 1 << 20


@pytest.fixture(autouse=True)
def clean_gpuipc() -> Iterator[None]:
    """Every test starts and ends with no share, nothing pending, off."""
    gpuipc.release_all()
    gpuipc.claim()
    gpuipc.configure(False)
    yield
    gpuipc.release_all()
    gpuipc.claim()
    gpuipc.configure(False)


# -- the flag ---------------------------------------------------------------------------------
def test_flag_is_off_by_default_and_must_be_a_bool() -> None:
    assert MeshConfig().gpu_ipc is False
    assert MeshConfig(gpu_ipc=True).gpu_ipc is True
    for bad in ("yes", 1, None):
        with pytest.raises(UsageError, match="gpu_ipc must be True or False"):
            MeshConfig(gpu_ipc=bad)  # type: ignore[arg-type]


def test_rank_reads_the_flag_from_its_environment() -> None:
    base = {"RANK": "0", "WORLD_SIZE": "1", ENV_CONTROLLER: "tcp://h:1", "MONARCH_NB_KEY": "00"}
    assert RankEnv.from_environ(base).gpu_ipc is False
    assert RankEnv.from_environ({**base, ENV_GPU_IPC: "1"}).gpu_ipc is True
    assert RankEnv.from_environ({**base, ENV_GPU_IPC: "0"}).gpu_ipc is False


def _supervisor(gpu_ipc: bool, launcher: object = None) -> Supervisor:
    extra = {} if launcher is None else {"launcher": launcher}
    return Supervisor(world_size=2, backend=backends.resolve("cpu"), controller_endpoint="tcp://x:1",
                      key=b"k" * 32, mesh_id="m", master_port=1, gpu_ipc=gpu_ipc, **extra)  # type: ignore[arg-type]


def test_supervisor_gives_the_flag_to_local_ranks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_GPU_IPC, "1")  # the kernel's own environment: not inherited
    for on, launcher, want in ((True, None, "1"), (False, None, None),
                               (True, SshLauncher(["h1", "h2"], 1, "10.0.0.1"), None)):
        sup = _supervisor(on, launcher)
        try:
            assert sup.env_for(1, 0, "ident").get(ENV_GPU_IPC) == want
        finally:
            sup.spawner.stop()
            sup.cleanup_logs()


def test_effective_says_why_it_stays_off() -> None:
    assert gpuipc.effective(False, "cuda", False) == (False, None)
    assert gpuipc.effective(True, "cuda", False, lambda: True) == (True, None)
    for backend, remote, cuda, why in (("cpu", False, True, "no GPU (backend cpu)"),
                                       ("rocm", True, True, "other hosts"),
                                       ("cuda", False, False, "torch.cuda is not available")):
        on, notice = gpuipc.effective(True, backend, remote, lambda c=cuda: c)
        assert on is False and notice is not None
        assert why in notice and "\n" not in notice and notice.startswith("monarch_nb: gpu_ipc")


def test_cpu_mesh_with_the_flag_prints_the_notice_and_works(capsys: pytest.CaptureFixture[str]) -> None:
    with Mesh.start(n=1, backend="cpu", gpu_ipc=True, spare=False) as mesh:
        err = capsys.readouterr().err
        assert err.count("gpu_ipc is on but this mesh has no GPU") == 1
        assert mesh._ctl.gpu_ipc_devices is None
        assert mesh.run(lambda: __import__("os").environ.get(ENV_GPU_IPC)) == {0: None}
        t = torch.arange(MiB // 2, dtype=torch.float32)  # 2 MiB: shared memory, as without the flag
        mesh.push(t=t)
        assert mesh.pull("t")[0].equal(t)


# -- the sender's choice ----------------------------------------------------------------------
def test_route_by_size_and_by_the_receivers_gpus() -> None:
    assert gpuipc.route(gpuipc.IPC_MIN - 1, 0, None) == "host"  # a handle costs more than the copy
    assert gpuipc.route(gpuipc.IPC_MIN, 0, None) == "ipc"  # a rank's result: the controller sees all
    assert gpuipc.route(64 * MiB, 1, frozenset({1})) == "ipc"
    assert gpuipc.route(64 * MiB, 0, frozenset({1})) == "host"  # the rank cannot see cuda:0
    assert gpuipc.route(64 * MiB, 0, frozenset()) == "host"


def test_sending_opens_by_handle_only_when_every_receiver_is_on_one_gpu() -> None:
    seen = []
    for devices in ([0], [2, 2], [0, 1], []):
        with gpuipc.sending(devices):
            scope = gpuipc._current_scope()
            assert scope is not None
            seen.append(scope.openable)
    assert seen == [frozenset({0}), frozenset({2}), frozenset(), frozenset()]
    assert gpuipc._current_scope() is None  # off again outside
    gpuipc.configure(True)  # a rank: its results go to the controller, which sees every GPU
    assert gpuipc._current_scope() is gpuipc._ANY


def test_only_cuda_tensors_reach_gpuipc(monkeypatch: pytest.MonkeyPatch) -> None:
    value = {"t": torch.arange(MiB, dtype=torch.float32), "p": torch.nn.Parameter(torch.ones(3)),
             "a": np.ones(MiB), "s": torch.ones(4)}
    off = serialize.dumps(value)

    def refuse(t: object) -> None:
        raise AssertionError(f"gpuipc asked about a {type(t).__name__} on the CPU")

    monkeypatch.setattr(gpuipc, "reduce", refuse)
    gpuipc.configure(True)
    with gpuipc.sending([0]):
        on = serialize.dumps(value)
    assert [bytes(f) for f in on] == [bytes(f) for f in off]  # the CPU path is unchanged
    assert gpuipc.outstanding() == 0


def test_reduce_is_a_no_op_when_this_process_does_not_send_by_ipc() -> None:
    assert gpuipc.reduce(object()) is None  # not even looked at


# -- the receiver -----------------------------------------------------------------------------
def test_a_handle_for_a_gpu_this_process_does_not_see_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"does not see .* start the mesh without gpu_ipc"):
        gpuipc._open("tok", "GPU-00000000-not-here", (), False, False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a process without CUDA")
def test_bytes_route_keeps_type_and_grad_where_there_is_no_gpu() -> None:
    t = gpuipc._restore(torch.ones(3), "GPU-x", True, False)
    assert type(t) is torch.Tensor and t.requires_grad and t.device.type == "cpu"
    p = gpuipc._restore(torch.ones(3), None, False, True)
    assert type(p) is torch.nn.Parameter and not p.requires_grad


def test_mentioned_finds_shares_in_a_payload() -> None:
    with_share = [pickle.dumps((gpuipc._open, ("tok",)))]
    assert gpuipc.mentioned(with_share)
    assert not gpuipc.mentioned(serialize.dumps({"x": torch.ones(4)}))


# -- who holds a share, and for how long -------------------------------------------------------
@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, int]]:
    """Fake shares (a real one needs a GPU): record torch's count releases."""
    calls: list[tuple[bytes, int]] = []

    def release_counter(counter: bytes, offset: int, device: int | None = None) -> None:
        calls.append((counter, offset))

    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter", release_counter,
                        raising=False)
    return calls


def _fake_share(tok: str, offset: int) -> None:
    with gpuipc._lock:
        gpuipc._shares[tok] = gpuipc._Share(object(), b"/torch_fake", offset, 0)
    gpuipc._pending().append(tok)


def test_a_share_is_released_once(released: list[tuple[bytes, int]]) -> None:
    _fake_share("a", 3)
    assert gpuipc.outstanding() == 1
    assert gpuipc.claim() == ["a"] and gpuipc.claim() == []
    assert gpuipc.release("a") is True
    assert gpuipc.release("a") is False  # a second RELEASE (or a stranger's token) is ignored
    assert released == [(b"/torch_fake", 3)] and gpuipc.outstanding() == 0


def test_shares_of_a_payload_never_sent_are_released(released: list[tuple[bytes, int]]) -> None:
    _fake_share("a", 1)
    _fake_share("b", 2)
    gpuipc.release_pending()
    assert sorted(released) == [(b"/torch_fake", 1), (b"/torch_fake", 2)]
    assert gpuipc.outstanding() == 0


def test_the_call_holds_its_shares_until_it_finishes(released: list[tuple[bytes, int]]) -> None:
    plane = DataPlane("m", None, 1 << 30, gpu_ipc=True)
    _fake_share("a", 1)
    plane.pack_call(7, [b"x"])  # the shares pickled on this thread become call 7's
    _fake_share("b", 2)
    plane.pack_call(8, [b"y"])
    assert gpuipc.outstanding() == 2 and released == []
    plane.release(7)
    assert released == [(b"/torch_fake", 1)]
    plane.close_all()  # the mesh stops
    assert released == [(b"/torch_fake", 1), (b"/torch_fake", 2)] and gpuipc.outstanding() == 0


# -- with a GPU -------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="opening a CUDA IPC handle needs a GPU")
def test_push_and_pull_by_handle_on_a_gpu() -> None:
    src = torch.arange(4 * MiB // 4, dtype=torch.float32, device="cuda:0")
    with Mesh.start(n=1, backend="cuda", gpu_ipc=True, spare=False) as mesh:
        mesh.push(g=src)
        assert mesh.run(lambda: (str(g.device), float(g.sum())))[0] == ("cuda:0", float(src.sum()))  # type: ignore[name-defined]  # noqa: F821
        mesh.exec("g.add_(1)")
        assert float(src[0]) == 0.0  # the rank's copy is its own
        back = mesh.pull("g")[0]
        assert back.is_cuda and float(back[0]) == 1.0 and gpuipc.outstanding() == 0
        back.zero_()
        assert mesh.exec("float(g[0])") == {0: 1.0}
