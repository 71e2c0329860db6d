"""Unit tests for monarch_nb.config: MeshConfig validation, keys, RankEnv."""

from __future__ import annotations

import dataclasses
import os
import stat
import threading

import pytest

from monarch_nb import config
from monarch_nb.config import (
    ENV_BACKEND,
    ENV_CONTROLLER,
    ENV_CONTROLLER_TIMEOUT,
    ENV_GENERATION,
    ENV_INCARNATION,
    ENV_KEY,
    ENV_KEY_FILE,
    ENV_MESH_ID,
    ENV_PARENT_PID,
    MeshConfig,
    RankEnv,
    default_cpu_ranks,
    read_key,
    write_key_file,
)
from monarch_nb.errors import UsageError

KEY = bytes(range(32))


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "mesh.key"
    write_key_file(str(path), KEY)
    return path


# -- MeshConfig ---------------------------------------------------------------

def test_defaults():
    cfg = MeshConfig()
    assert (cfg.n, cfg.backend, cfg.respawn, cfg.launcher, cfg.bind) == (None, "auto", "rank", "local", "127.0.0.1")
    assert cfg.hosts == () and cfg.extra_env == ()
    assert cfg.heartbeat_interval > 0 and cfg.controller_timeout > cfg.heartbeat_interval
    assert cfg.max_message_bytes == 4 << 30


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MeshConfig().n = 3


@pytest.mark.parametrize("kwargs", [
    {"n": 1}, {"n": 64}, {"backend": "cuda"}, {"backend": "rocm"}, {"backend": "cpu"},
    {"respawn": "all"}, {"respawn": "off"}, {"bind": "localhost"}, {"bind": "::1"},
])
def test_valid(kwargs):
    cfg = MeshConfig(**kwargs)
    for k, v in kwargs.items():
        assert getattr(cfg, k) == v


@pytest.mark.parametrize("n", [0, -1, 1.5, 2.0, "4", [4]])
def test_bad_n(n):
    with pytest.raises(UsageError, match="n must be a positive number of ranks"):
        MeshConfig(n=n)


def test_bool_n_rejected():
    try:
        MeshConfig(n=True)
    except UsageError:
        return
    raise AssertionError("MeshConfig(n=True) was accepted")


@pytest.mark.parametrize("field,value,options", [
    ("backend", "tpu", "auto, cuda, rocm, cpu"),
    ("backend", "CUDA", "auto, cuda, rocm, cpu"),
    ("respawn", "never", "rank, all, off"),
    ("launcher", "k8s", "local, ssh, slurm"),
])
def test_bad_choice(field, value, options):
    with pytest.raises(UsageError) as info:
        MeshConfig(**{field: value})
    assert repr(value) in str(info.value)
    assert options in str(info.value)


def test_ssh_launcher_needs_hosts():
    with pytest.raises(UsageError, match="--hosts"):
        MeshConfig(launcher="ssh")
    assert MeshConfig(launcher="ssh", hosts=("a", "b")).hosts == ("a", "b")


@pytest.mark.parametrize("bind", ["0.0.0.0", "10.1.2.3", "::", "*", "127.0.0.2", "example.com"])
def test_non_loopback_bind_turns_curve_on(bind):
    assert MeshConfig(bind=bind).encrypted
    assert not MeshConfig(bind=bind, insecure_no_encryption=True).encrypted


@pytest.mark.parametrize("bind", ["127.0.0.1", "localhost", "::1"])
def test_loopback_is_not_encrypted(bind):
    assert not MeshConfig(bind=bind).encrypted


@pytest.mark.parametrize("bind", ["", "bad host", "tcp://x", "a/b"])
def test_bad_bind_rejected(bind):
    with pytest.raises(UsageError, match="bind address"):
        MeshConfig(bind=bind)


def test_usage_errors_are_value_errors():
    with pytest.raises(ValueError):
        MeshConfig(backend="nope")


@pytest.mark.parametrize("cpus,expected", [(None, 1), (1, 1), (2, 2), (4, 4), (128, 4)])
def test_default_cpu_ranks(monkeypatch, cpus, expected):
    monkeypatch.setattr(config.os, "cpu_count", lambda: cpus)
    assert default_cpu_ranks() == expected


# -- keys ---------------------------------------------------------------------

def test_read_key_from_env():
    assert read_key({ENV_KEY: KEY.hex()}) == KEY


def test_env_key_wins_over_file(tmp_path, key_file):
    other = bytes(32)
    assert read_key({ENV_KEY: other.hex(), ENV_KEY_FILE: str(key_file)}) == other


def test_empty_env_key_falls_back_to_file(key_file):
    assert read_key({ENV_KEY: "", ENV_KEY_FILE: str(key_file)}) == KEY


def test_read_key_from_0600_file(key_file):
    assert mode_of(key_file) == 0o600
    assert read_key({ENV_KEY_FILE: str(key_file)}) == KEY


def test_read_key_file_with_trailing_newline(tmp_path):
    path = tmp_path / "k"
    path.write_text(KEY.hex() + "\n")
    os.chmod(path, 0o600)
    assert read_key({ENV_KEY_FILE: str(path)}) == KEY


def test_read_key_file_0400(tmp_path):
    path = tmp_path / "k"
    path.write_text(KEY.hex())
    os.chmod(path, 0o400)
    assert read_key({ENV_KEY_FILE: str(path)}) == KEY


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o666, 0o620, 0o602, 0o610, 0o601])
def test_key_file_readable_by_others_refused(key_file, mode):
    os.chmod(key_file, mode)
    with pytest.raises(UsageError) as info:
        read_key({ENV_KEY_FILE: str(key_file)})
    assert "chmod 600" in str(info.value)
    assert str(key_file) in str(info.value)


def test_no_key():
    with pytest.raises(UsageError) as info:
        read_key({})
    assert ENV_KEY in str(info.value) and ENV_KEY_FILE in str(info.value)


def test_read_key_from_os_environ(monkeypatch):
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    monkeypatch.setenv(ENV_KEY, KEY.hex())
    assert read_key(os.environ) == KEY


def test_write_key_file_content(key_file):
    assert key_file.read_text() == KEY.hex()


def test_write_key_file_is_0600_even_with_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "k"
        write_key_file(str(path), KEY)
    finally:
        os.umask(old)
    assert mode_of(path) == 0o600


def test_write_key_file_replaces_a_readable_file(tmp_path):
    path = tmp_path / "k"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_key_file(str(path), KEY)
    assert mode_of(path) == 0o600
    assert read_key({ENV_KEY_FILE: str(path)}) == KEY


def test_write_key_file_leaves_no_temporary_file(tmp_path):
    write_key_file(str(tmp_path / "k"), KEY)
    assert [p.name for p in tmp_path.iterdir()] == ["k"]


def test_write_secret_file_from_several_threads_at_once(tmp_path, monkeypatch):
    """Threads of one process writing the same file at the same moment (a
    kept agent's status: its admitting thread and its main thread) each
    write whole: none fails on the other's temporary file."""
    path = tmp_path / "status.json"
    inside = threading.Barrier(2, timeout=5)
    real_write = os.write

    def both_inside(fd, data):  # both temporary files exist before either is written
        inside.wait()
        return real_write(fd, data)

    monkeypatch.setattr(config.os, "write", both_inside)
    errors: list[BaseException] = []

    def write(data: bytes) -> None:
        try:
            config.write_secret_file(str(path), data)
        except BaseException as exc:  # said by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(d,)) for d in (b"one", b"two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == []
    assert path.read_bytes() in (b"one", b"two")
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_write_key_file_is_0600_from_the_first_byte_and_atomic(tmp_path, monkeypatch):
    """When the key bytes are written, the file holding them is already 0600
    and is not yet at the final path (which appears only by rename)."""
    path = tmp_path / "k"
    seen = []
    real_write = os.write

    def spy_write(fd, data):
        seen.append((stat.S_IMODE(os.fstat(fd).st_mode), path.exists()))
        return real_write(fd, data)

    monkeypatch.setattr(config.os, "write", spy_write)
    write_key_file(str(path), KEY)
    assert seen and all(mode == 0o600 and not exists for mode, exists in seen)
    assert path.read_text() == KEY.hex()


# -- RankEnv ------------------------------------------------------------------

def full_env(key_hex: str = KEY.hex()) -> dict[str, str]:
    return {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        ENV_CONTROLLER: "tcp://127.0.0.1:5555",
        ENV_KEY: key_hex,
        ENV_MESH_ID: "mesh-abc",
        ENV_INCARNATION: "2",
        ENV_BACKEND: "cuda",
        ENV_PARENT_PID: "4242",
        ENV_CONTROLLER_TIMEOUT: "7.5",
        ENV_GENERATION: "5",
    }


def test_rank_env_full():
    env = RankEnv.from_environ(full_env())
    assert env == RankEnv(
        rank=3, world_size=8, local_rank=1, local_world_size=2, master_addr="10.0.0.1",
        master_port=29500, controller="tcp://127.0.0.1:5555", key=KEY, mesh_id="mesh-abc",
        incarnation=2, backend="cuda", parent_pid=4242, controller_timeout=7.5, generation=5,
        identity="r3.2", max_message_bytes=4 << 30,
    )


def test_rank_env_defaults():
    env = RankEnv.from_environ({"RANK": "2", "WORLD_SIZE": "4", ENV_CONTROLLER: "tcp://h:1",
                                ENV_KEY: KEY.hex()})
    assert env.local_rank == 2 and env.local_world_size == 4
    assert env.master_addr == "127.0.0.1" and env.master_port == 0
    assert env.mesh_id == "" and env.incarnation == 0 and env.generation == 0
    assert env.backend == "cpu"
    assert env.parent_pid is None
    assert env.controller_timeout == 10.0


def test_rank_env_key_from_file(key_file):
    env = full_env()
    del env[ENV_KEY]
    env[ENV_KEY_FILE] = str(key_file)
    assert RankEnv.from_environ(env).key == KEY


def test_rank_env_empty_parent_pid():
    env = full_env()
    env[ENV_PARENT_PID] = ""
    assert RankEnv.from_environ(env).parent_pid is None


def test_rank_env_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RankEnv.from_environ(full_env()).rank = 0


@pytest.mark.parametrize("missing", [["RANK"], ["WORLD_SIZE"], [ENV_CONTROLLER], ["RANK", ENV_CONTROLLER]])
def test_not_a_rank(missing):
    env = full_env()
    for name in missing:
        del env[name]
    with pytest.raises(UsageError) as info:
        RankEnv.from_environ(env)
    msg = str(info.value)
    assert "not a monarch_nb rank" in msg
    assert f"missing {', '.join(missing)}" in msg
    assert "Mesh.start" in msg


def test_not_a_rank_empty_dict():
    with pytest.raises(UsageError, match=f"missing RANK, WORLD_SIZE, {ENV_CONTROLLER}"):
        RankEnv.from_environ({})


def test_rank_without_key():
    env = full_env()
    del env[ENV_KEY]
    with pytest.raises(UsageError, match="no mesh key"):
        RankEnv.from_environ(env)


def test_rank_env_from_os_environ(monkeypatch):
    for name, value in full_env().items():
        monkeypatch.setenv(name, value)
    assert RankEnv.from_environ().rank == 3


def test_rank_env_from_os_environ_not_a_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", ENV_CONTROLLER):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match="not a monarch_nb rank"):
        RankEnv.from_environ()
