"""The ranks' log directories: made per mesh, and swept when their owner died.

One job: a mesh's ranks log into ``<tmp>/monarch-nb-XXXXXXXX`` (0700; the
supervisor removes it when the mesh stops). A controller that is SIGKILLed
(a kernel killed by Jupyter or the OOM killer) never gets to remove it, so
each directory carries an ``owner`` file naming its controller (pid and
process start time: a pid alone may be reused), and the next mesh started
by the same user removes the directories whose owner is gone.

Only directories that carry an owner file, belong to this user and are
not symlinks are touched: a directory of a live controller, of another
user, or of a version without the owner file is left alone.

Non-goals: what goes into the logs (supervisor), reading them (%monarch logs).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

import psutil

PREFIX = "monarch-nb-"
OWNER = "owner"


def make() -> str:
    """A new log directory (0700) marked as this process's."""
    path = tempfile.mkdtemp(prefix=PREFIX)
    os.chmod(path, 0o700)
    me = psutil.Process()
    fd = os.open(os.path.join(path, OWNER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{me.pid} {me.create_time():.3f}\n")
    return path


def _owner_alive(text: str) -> bool:
    try:
        pid_s, started_s = text.split()
        pid, started = int(pid_s), float(started_s)
    except ValueError:
        return True  # unreadable: not ours to judge
    try:
        return abs(psutil.Process(pid).create_time() - started) < 0.01
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def sweep(root: str | None = None) -> list[str]:
    """Remove this user's log directories whose controller is gone; the
    paths removed."""
    root = root or tempfile.gettempdir()
    uid = os.getuid()
    removed = []
    for path in glob.glob(os.path.join(root, PREFIX + "*")):
        try:
            st = os.lstat(path)
            if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != uid:
                continue
            with open(os.path.join(path, OWNER)) as f:
                text = f.read(100)
        except OSError:
            continue  # no owner file (another version, or being made): leave it
        if not _owner_alive(text):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
