"""The supervisor's side of spare processes: start one, hand it a rank, discard it.

A spare is a fresh ``python -m monarch_nb.worker`` (or, with ``fork``, a
fork of the warm process: procs/warm.py) with torch imported that waits on
its stdin for a rank's environment (see engine/spare.py for the
spare's own side and why this is safe on GPUs).

Non-goals: when to keep a spare (recovery), spawning ranks (supervisor).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ..config import ENV_SPARE, private
from ..config import SPARE_WAITING as WAITING
from .launchers import Handle


def is_waiting(log_path: str) -> bool:
    """The spare behind ``log_path`` has imported torch and waits."""
    try:
        with open(log_path, "rb") as f:
            return WAITING.encode() in f.read(4096)
    except OSError:
        return False


def start(env: dict[str, str], log_path: str,
          pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """Start a spare (on the supervisor's thread: see supervisor.py on why);
    ``pass_fds``: its end of a link, named in the assignment."""
    env = {**env, ENV_SPARE: "1"}
    with open(log_path, "ab", buffering=0, opener=private) as log:
        return subprocess.Popen(
            [sys.executable, "-m", "monarch_nb.worker"],
            env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, pass_fds=pass_fds,
        )


def assign(popen: Handle, env: dict[str, str], log_path: str) -> bool:
    """Make a waiting spare rank ``env``; False if it is gone."""
    if popen.poll() is not None or popen.stdin is None:
        return False
    line = json.dumps({"env": env, "log": log_path, "cwd": os.getcwd()}).encode() + b"\n"
    try:
        popen.stdin.write(line)
        popen.stdin.close()
    except OSError:  # it died just now
        return False
    return True


def discard(popen: Handle) -> None:
    """End a spare nobody needs (end of file on its pipe, then SIGKILL)."""
    try:
        if popen.stdin is not None:
            popen.stdin.close()
    except OSError:
        pass
    if popen.poll() is None:
        try:
            popen.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=5.0)
