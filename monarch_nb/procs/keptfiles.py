"""A kept mesh's runtime files: where a new controller finds it.

Every kept mesh of a user on this machine has, in the user's Jupyter
runtime directory (``jupyter --runtime-dir``; ``JUPYTER_RUNTIME_DIR`` moves
it), in a private folder ``monarch-nb/`` (0700):

* ``NAME.json`` (0600): the mesh's *record*: its key, id, size, backend, the
  controller's port the ranks reconnect to, its settings. Attaching needs
  it: nobody else can read it, so another user can neither list nor attach.
* ``NAME.status.json`` (0600): written by the mesh's host agent at each
  attach and detach: who is attached since when, or since when nobody is
  (the lease), and the agent's pid.
* the agent's Unix socket (0600), under a short name (a socket path is
  limited to 108 bytes).

The host agent removes all three when the mesh ends (a lease that ran out,
``monarch-nb stop``, ``mesh.stop()``); the ranks' logs stay, in
``NAME.logs/``.

Non-goals: the agent's side (keptagent.py), the controller's (controller/keep.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from .. import config
from ..errors import UsageError

FOLDER = "monarch-nb"


def runtime_dir() -> str:
    """The private folder of this user's kept meshes (made 0700 if new)."""
    from jupyter_core.paths import jupyter_runtime_dir

    path = os.path.join(jupyter_runtime_dir(), FOLDER)
    os.makedirs(path, mode=0o700, exist_ok=True)
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        os.chmod(path, 0o700)
    return path


def record_path(name: str) -> str:
    return os.path.join(runtime_dir(), f"{name}.json")


def status_path(name: str) -> str:
    return os.path.join(runtime_dir(), f"{name}.status.json")


def log_dir(name: str) -> str:
    path = os.path.join(runtime_dir(), f"{name}.logs")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def socket_path(name: str) -> str:
    short = hashlib.sha256(name.encode()).hexdigest()[:16]
    return os.path.join(runtime_dir(), f"s-{short}.sock")


@dataclass
class Record:
    """What a controller needs to attach to a kept mesh (``NAME.json``)."""

    name: str
    key: str  # the mesh key, hex
    mesh_id: str
    world_size: int
    backend: dict[str, Any]  # backends.BackendInfo's fields
    port: int  # the controller's ROUTER port the ranks reconnect to
    keep_alive: float
    config: dict[str, Any]  # MeshConfig's fields that a new controller keeps
    created: float = field(default_factory=time.time)
    host: str = field(default_factory=lambda: os.uname().nodename)
    # CurveZMQ keys (Z85) of a mesh beyond loopback: its ranks and agents hold the
    # client pair and reconnect to the same server key (wire/endpoints.py)
    curve: dict[str, str] | None = None

    def write(self) -> None:
        config.write_secret_file(record_path(self.name),
                                 json.dumps(asdict(self), indent=1).encode())


def read_record(name: str) -> Record:
    """The record of kept mesh ``name``; UsageError naming what exists if none."""
    path = record_path(name)
    try:
        st = os.stat(path)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise UsageError(f"{path} is not a private file of yours; refusing to use it")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return Record(**data)
    except FileNotFoundError:
        names = [m["name"] for m in list_meshes()]
        raise UsageError(f"no kept mesh named {name!r} on this machine"
                         + (f" (kept meshes: {', '.join(names)})" if names else
                            " (none is kept; start one with %monarch start --name NAME "
                            "--keep-alive 30m)")) from None
    except (ValueError, TypeError) as exc:
        raise UsageError(f"the record of kept mesh {name!r} ({path}) is damaged: {exc}; "
                         f"`monarch-nb stop {name}` removes it") from None


def write_status(name: str, status: dict[str, Any]) -> None:
    config.write_secret_file(status_path(name), json.dumps(status).encode())


def read_status(name: str) -> dict[str, Any]:
    try:
        with open(status_path(name), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def agent_alive(status: dict[str, Any]) -> bool:
    pid = status.get("agent_pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE \
            and "monarch_nb.agent" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def remove(name: str) -> None:
    """The mesh's runtime files (its logs stay)."""
    for path in (record_path(name), status_path(name), socket_path(name)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def list_meshes() -> list[dict[str, Any]]:
    """One row per kept mesh of this user on this machine: name, ranks,
    hosts, started (epoch seconds), attached (``pid P on H since T``) or
    ``""``, lease_left (seconds, None while attached). Records whose agent is
    gone (the machine rebooted) are removed on the way."""
    folder = runtime_dir()
    rows = []
    for entry in sorted(os.listdir(folder)):
        if not entry.endswith(".json") or entry.endswith(".status.json"):
            continue
        name = entry[:-5]
        try:
            rec = read_record(name)
        except UsageError:
            continue
        status = read_status(name)
        if not agent_alive(status):
            if time.time() - rec.created > 60:  # (a mesh being started has no agent yet)
                remove(name)
            continue
        attached = status.get("attached") or {}
        since = status.get("detached_since")
        lease = None
        if not attached and isinstance(since, (int, float)):
            lease = max(0.0, rec.keep_alive - (time.time() - since))
        rows.append({
            "name": rec.name, "ranks": rec.world_size,
            "hosts": list(rec.config.get("hosts") or []) or [rec.host],
            "started": rec.created,
            "attached": (f"pid {attached.get('pid')} on {attached.get('host')} since "
                         f"{time.strftime('%H:%M:%S', time.localtime(attached.get('since', 0)))}"
                         if attached else ""),
            "lease_left": lease,
        })
    return rows


__all__ = ["Record", "agent_alive", "list_meshes", "log_dir", "read_record", "read_status",
           "record_path", "remove", "runtime_dir", "socket_path", "status_path", "write_status"]
