"""nbval runs these notebooks (``make test``); this guards against the rank
processes a notebook leaves behind.

Each notebook stops its own mesh in its last cell. nbval's items take no
fixtures, so the check is a teardown hook: after the last cell of each
notebook, every ``monarch_nb.worker`` process started under this pytest run
(tagged through the environment, which the kernel and its ranks inherit, as in
tests/conftest.py) must be gone within a few seconds; leftovers are killed and
that cell's teardown fails, naming the notebook.

Non-goals: running the notebooks (nbval), checking outputs (nbval_sanitize.cfg).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import psutil

TAG_VAR = "MONARCH_NB_TEST_SESSION"
# tests/conftest.py sets its own tag when the run includes tests/; read it late.
os.environ.setdefault(TAG_VAR, f"nb-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def rank_pids() -> set[int]:
    """Live rank (and spare) processes carrying this run's tag."""
    tag = os.environ.get(TAG_VAR)
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            rank = "monarch_nb.worker" in cmd or ("monarch_nb.cli" in cmd and "worker" in cmd)
            if rank and p.environ().get(TAG_VAR) == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _notebook(item: Any) -> Any:
    return getattr(item, "parent", None) if item is not None else None


def pytest_runtest_teardown(item: Any, nextitem: Any) -> None:
    if not str(getattr(item, "fspath", "")).endswith(".ipynb"):
        return
    if _notebook(nextitem) is _notebook(item):
        return  # not the notebook's last cell
    deadline = time.monotonic() + 10
    while rank_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = rank_pids()
    for pid in leaked:  # leave the machine usable, then fail loudly
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    assert not leaked, (f"{item.fspath}: rank processes outlived the notebook's last cell: "
                        f"{sorted(leaked)} (does it end with %monarch stop?)")
