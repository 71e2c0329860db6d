"""Rank side of script mode: run a user's file as ``__main__`` on a rank.

``python -m monarch_nb.launch train.py --lr 0.1`` sends :func:`run_script`
to every rank (by reference: this module is imported on the rank). It sets
``sys.argv`` to ``[train.py, --lr, 0.1]``, puts the script's folder first on
``sys.path`` and runs the file with ``__name__ == "__main__"``, like
``python train.py`` or torchrun would.

torchrun compatibility: the rank already belongs to its torch.distributed
group before the script starts (the worker joins it, so respawn can re-form
it), and the usual environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) is set. While the
script runs, ``dist.init_process_group()`` therefore returns at once when the
group exists (a script written for torchrun calls it first thing), and
``dist.destroy_process_group()`` of the default group is a no-op (the group
belongs to the mesh, which re-forms it after a death).

``SystemExit(0)`` / ``sys.exit()`` count as success; any other exit status
is raised as :class:`ScriptExit` so the launcher can exit with that code.

Non-goals: argument parsing and the terminal (launch.py), respawn (controller).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Iterator
from typing import Any


class ScriptExit(Exception):
    """The script called ``sys.exit(code)`` with a non-zero code."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(f"{code}" + (f": {message}" if message else ""))
        self.code = code


@contextlib.contextmanager
def _torchrun_compat() -> Iterator[None]:
    """Make ``init_process_group`` / ``destroy_process_group`` of the default
    group no-ops while the script runs (see the module docstring)."""
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        yield
        return
    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group

    # Only the script's calls are changed: monarch_nb's own (the worker
    # re-forming the group after a death, inside mnb.elastic) must reach torch.
    # (by file: the worker runs as __main__, so its module name says nothing)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

    def ours() -> bool:
        return os.path.abspath(sys._getframe(2).f_code.co_filename).startswith(package)

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if dist.is_initialized() and not ours():
            return None
        return real_init(*args, **kwargs)

    def destroy_process_group(group: Any = None) -> None:
        if (group is None or group is dist.group.WORLD) and not ours():
            return None  # the mesh's group: it outlives the script
        return real_destroy(group)

    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
    try:
        yield
    finally:
        dist.init_process_group, dist.destroy_process_group = real_init, real_destroy


def run_script(path: str, args: list[str], cwd: str | None = None) -> None:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]``."""
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"script {path} does not exist on this host "
                                f"({os.uname().nodename}); every node needs the same path")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    try:
        with _torchrun_compat():
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return
        if isinstance(code, int):
            raise ScriptExit(code) from None
        raise ScriptExit(1, str(code)) from None  # sys.exit("message") exits 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()


__all__ = ["ScriptExit", "run_script"]
