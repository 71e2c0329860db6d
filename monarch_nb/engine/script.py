"""Rank side of script mode: run a user's file as ``__main__`` on a rank.

``python -m monarch_nb.launch train.py --lr 0.1`` sends :func:`run_script`
to every rank (by reference: this module is imported on the rank). It sets
``sys.argv`` to ``[train.py, --lr, 0.1]``, puts the script's folder first on
``sys.path`` and runs the file with ``__name__ == "__main__"``, like
``python train.py`` or torchrun would; ``-m pkg.train`` runs a module as
``python -m`` does, and ``--no-python`` runs a program as a child of the rank.

torchrun compatibility: the rank already belongs to its torch.distributed
group before the script starts (the worker joins it, so respawn can re-form
it), and torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``GROUP_RANK``, ``ROLE_*``, ``TORCHELASTIC_*``, ``MASTER_ADDR/PORT``) is set
(supervisor.py). The script's own ``init_process_group()`` keeps the mesh's
group and its ``destroy_process_group()`` leaves it in place (pgcompat.py).

``SystemExit(0)`` / ``sys.exit()`` count as success; any other exit status
is raised as :class:`ScriptExit` so the launcher can exit with that code.

Non-goals: argument parsing and the terminal (launch.py), respawn (controller).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import runpy
import subprocess
import sys
import threading
import types
import zipfile
from typing import Any

from . import pgcompat


class ScriptExit(Exception):
    """The script called ``sys.exit(code)`` with a non-zero code."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(f"{code}" + (f": {message}" if message else ""))
        self.code = code


def run_script(path: str, args: list[str], cwd: str | None = None, mode: str = "path",
               port: int | None = None) -> None:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]``.

    ``mode``: ``"path"`` a Python file (``python train.py``), ``"module"`` a
    module name (``python -m pkg.train``, torchrun's ``-m``), ``"exec"`` a
    program run as a child of the rank (torchrun's ``--no-python``) with the
    rank's environment, its own group formed on ``port``."""
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    if mode == "exec":
        _run_program(path, args, port)
        return
    where = os.path.abspath(path)
    if mode == "path" and not os.path.isfile(where):
        raise FileNotFoundError(f"script {where} does not exist on this host "
                                f"({os.uname().nodename}); every node needs the same path")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]  # as typed, like `python train.py`
    sys.path.insert(0, os.path.dirname(where) if mode == "path" else os.getcwd())
    pgcompat.install()
    try:
        with pgcompat.quiet_destroy():
            if mode == "module":
                # like `python -m`: argv[0] is the module's file, found first
                spec = importlib.util.find_spec(path)
                if spec is None:
                    raise ModuleNotFoundError(f"No module named {path!r} (run from {os.getcwd()})")
                sys.argv[0] = spec.origin or path
                runpy.run_module(path, run_name="__main__", alter_sys=True)
            elif os.path.isfile(where) and not zipfile.is_zipfile(where):
                _run_file(where)
            else:  # a folder or zip with __main__.py
                runpy.run_path(where, run_name="__main__")
    except SystemExit as exc:
        _raise_exit(exc.code)
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()


def _run_file(path: str) -> None:
    """``python path`` in this interpreter: ``__main__`` is a fresh module
    while it runs. (runpy.run_path would also set ``sys.argv[0]`` to the
    absolute path; python and torchrun leave it as typed.)"""
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __spec__=None, __loader__=None,
                           __builtins__=__builtins__)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _raise_exit(code: object) -> None:
    if code is None or code == 0:
        return
    if isinstance(code, int):
        raise ScriptExit(code) from None
    raise ScriptExit(1, str(code)) from None  # sys.exit("message") exits 1


def _run_program(program: str, args: list[str], port: int | None) -> None:
    """torchrun's ``--no-python``: the program is a child of this rank with
    the rank's torchrun environment; it forms its own torch.distributed group
    (the mesh's is this rank's), on ``port`` hosted by rank 0's program."""
    env = dict(os.environ)
    for var in [k for k in env if k.startswith("MONARCH_NB_")]:
        env.pop(var)  # the mesh's keys stay with the rank
    if port:
        env["MASTER_PORT"] = str(port)
    env["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0's program hosts the store

    def die_with_rank() -> None:
        import ctypes
        import signal

        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)

    proc = subprocess.Popen([program, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            preexec_fn=die_with_rank if sys.platform.startswith("linux") else None)

    def pump(src: Any, dst: Any) -> None:
        for line in iter(src.readline, b""):
            dst.write(line.decode("utf-8", "replace"))
            dst.flush()

    err = threading.Thread(target=pump, args=(proc.stderr, sys.stderr), daemon=True)
    err.start()
    try:
        pump(proc.stdout, sys.stdout)
        code = proc.wait()
    except BaseException:  # an interrupt: the program goes with the call
        proc.kill()
        proc.wait()
        raise
    err.join(5)
    if code < 0:
        raise ScriptExit(128 - code, f"{program} killed by signal {-code}")
    _raise_exit(code)


__all__ = ["ScriptExit", "run_script"]
