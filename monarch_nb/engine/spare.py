"""A spare rank process: started ahead of need, torch already imported,
waiting to be told which rank it is.

Respawning a rank is dominated by the new interpreter's ``import torch``
(over a second on a small machine). The local supervisor therefore keeps one
spare: a fresh interpreter (never a fork of anything that touched CUDA) that
imports torch and ``torch.distributed`` and then blocks reading one line from
its stdin pipe. When a rank dies, the supervisor writes that rank's
environment (rank, incarnation, identity, key, device pinning...) and log file
to the pipe; the spare applies them and carries on as an ordinary worker,
joining the new group at once.

A rank made from a spare is the rank a fresh start would give: the spare is
started with the settings read when torch is imported (the rank's
``OMP_NUM_THREADS`` default, so its intra- and inter-op thread pools are
sized alike: the inter-op count can be set only once, before any work), and
at hand-off it takes the rank's whole environment (replacing its own), its
working directory, the ``sys.path`` entries those give, and its torch thread
count (``apply``).

Why this is safe on GPUs: ``import torch`` does not initialise CUDA or HIP;
the device pinning variables are read when the runtime initialises, which
happens after the assignment, like in a rank started from scratch.

The key reaches the spare through the pipe, never argv. A spare whose parent
dies gets the parent-death signal, and end of file on its pipe (the
supervisor closing it, or dying) makes it exit.

This module is the spare's side; starting, assigning and discarding one is
procs/spares.py.

Non-goals: when to keep a spare (controller), spawning ranks (supervisor).
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO

from ..config import ENV_SPARE
from ..config import SPARE_WAITING as WAITING


def wait_for_assignment(stdin: IO[bytes] | None = None) -> None:
    """Rank side, in a spare: import torch, then wait for the assignment and
    apply it (environment, and stdout/stderr to the rank's log)."""
    import torch  # the point of a spare
    import torch.distributed  # noqa: F401

    print(WAITING, flush=True)
    stream = stdin or sys.stdin.buffer
    line = stream.readline()
    if not line:
        os._exit(0)  # closed without an assignment: not needed any more
    assignment = json.loads(line)
    apply(assignment)
    fd = os.open(assignment["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def apply(assignment: dict[str, object]) -> None:
    """Become the rank ``assignment`` describes, as if started fresh with its
    environment in its working directory (logs aside: see above)."""
    import torch

    env = assignment["env"]
    assert isinstance(env, dict)
    old_path = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    os.environ.pop(ENV_SPARE, None)
    cwd = assignment.get("cwd")
    if isinstance(cwd, str) and cwd != os.getcwd():
        os.chdir(cwd)
        if sys.path and not sys.path[0].endswith(".zip"):
            sys.path[0] = cwd  # ``python -m``'s first entry: the start directory
    new_path = os.environ.get("PYTHONPATH", "")
    if new_path != old_path:  # the entries PYTHONPATH put after sys.path[0]
        old = [p for p in old_path.split(os.pathsep) if p]
        new = [os.path.abspath(p) for p in new_path.split(os.pathsep) if p]
        rest = [p for p in sys.path[1:] if p not in {os.path.abspath(q) for q in old}]
        sys.path[1:] = new + rest
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))
