"""A short soak (``-m soak``; benchmarks/soak.py is the long one): ~500 mixed
calls on a 2-rank CPU mesh with 3 respawns and 1 stop/start cycle, then the
controller's file descriptors, threads, ZeroMQ sockets and child processes,
and the pending calls, must be where they were after warm-up, give or take a
small bound (a spare process and its pipe may come and go). Not timed: the
latency figures are printed for the log, never asserted.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_SOAK = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("monarch_nb_soak", _SOAK)
assert _spec is not None and _spec.loader is not None
soak = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = soak  # (cloudpickle ships its functions by value: see soak.py)
_spec.loader.exec_module(soak)

pytestmark = pytest.mark.soak

# column: how much it may grow from the first sample after warm-up to the last
BOUNDS = {"ctl_fds": 8, "ctl_threads": 2, "zmq_sockets": 2, "children": 1, "pending": 0}


def test_short_soak_does_not_grow() -> None:
    report = soak.soak(calls=500, respawns=3, cycles=1, ranks=2, sample_every=50)
    print("\n" + soak.render(report))
    assert report.kinds.get("error", 0) + report.kinds.get("timeout", 0) == report.errors_expected
    warm, last = report.samples[1], report.samples[-1]
    grown = {c: getattr(last, c) - getattr(warm, c) for c in BOUNDS}
    assert all(grown[c] <= BOUNDS[c] for c in BOUNDS), (grown, soak.render(report))
    assert last.pending == 0
