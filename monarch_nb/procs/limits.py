"""The machine's limits a mesh runs into, checked before it starts: the
open-file limit and the space left for the ranks' logs.

Each rank costs the controller a few descriptors (two ZeroMQ connections, a
pidfd, its log, a pipe), and each rank holds one connection per peer for its
gloo group. Without room the mesh fails half-way with "Too many open files"
from inside gloo or ZeroMQ. So the soft limit is raised (up to the hard one,
as the shell's ``ulimit -n`` would; ranks inherit it), and a hard limit too
low is refused up front, saying what to change.

Non-goals: memory limits (a rank's death by the OOM killer is reported as a
death), ports (ZeroMQ and gloo bind to ports the kernel picks).
"""

from __future__ import annotations

import resource
import shutil

from ..errors import UsageError

BASE_FILES = 48  # the kernel, torch, ZeroMQ's own (a 4-rank mesh failed at 30 here, 8 ranks ran at 64)
FILES_PER_RANK = 4  # controller: 2 connections, pidfd, log; rank: a peer connection each
COMFORT_FILES = 4096  # raised to this at least when allowed: user code opens files too
LOG_SPACE_LOW = 16 << 20  # less than this free for the logs earns a notice


def files_needed(world_size: int) -> int:
    return BASE_FILES + FILES_PER_RANK * world_size


def ensure_open_files(world_size: int) -> int:
    """Raise the soft open-file limit to what ``world_size`` ranks need (and
    at least ``COMFORT_FILES``, within the hard limit); return the limit.
    UsageError when the hard limit is too low."""
    need = files_needed(world_size)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if hard != infinite and hard < need:
        raise UsageError(
            f"the open-file limit is {hard} (ulimit -n, hard), and a mesh of {world_size} ranks "
            f"needs about {need}: raise it (ulimit -n {need} in the shell that starts Jupyter, "
            f"or LimitNOFILE= for a service), or start fewer ranks")
    want = max(need, COMFORT_FILES)
    if hard != infinite:
        want = min(want, hard)
    if soft == infinite or soft >= want:
        return soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want


def log_space_notice(log_dir: str) -> str:
    """A one-line notice when the ranks' log directory is nearly full ("" if
    not): the mesh works without its logs (output reaches the cell over the
    sockets), but ``%monarch logs`` and death reports lose their tails."""
    try:
        free = shutil.disk_usage(log_dir).free
    except OSError:
        return ""
    if free >= LOG_SPACE_LOW:
        return ""
    return (f"monarch_nb: only {free >> 10} KiB free for the ranks' logs in {log_dir}; "
            "%monarch logs and death reports may lose their last lines (free some space, "
            "or point TMPDIR elsewhere)")
