"""Shared fixtures: real meshes, real kernels, and a guard against orphans.

Every test that starts rank processes must stop them: ``no_leftovers``
fails the test that leaves one behind, and the ``no_orphans`` session
fixture the run if any ``monarch_nb.worker`` process outlives the tests
(a leaked rank is a product bug, not a test nuisance).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator

import psutil
import pytest
from hypothesis import HealthCheck, settings

from monarch_nb import Mesh

# Property tests on a shared, noisy machine: no timing checks (a timed
# assertion in disguise), every example run whatever its speed; each test
# still sets its own max_examples.
settings.register_profile("shared-machine", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-machine")

# Every process this test session starts (ranks, kernels and their ranks)
# inherits this tag, so the orphan check sees our ranks and nobody else's.
SESSION_TAG = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
os.environ["MONARCH_NB_TEST_SESSION"] = SESSION_TAG


# `make test` runs the suite in two pytest-xdist workers, one test file at a
# time each (`-n 2 --dist loadfile`: a file's module-scoped mesh starts once, a
# notebook's cells share one kernel, in order). Most of a test's time is spent
# waiting on rank processes, so the second worker uses the core the first
# leaves idle. (Tests that build network namespaces take a lock: engines.py.)
# The longest files go first (`--no-loadscope-reorder` keeps this order), so
# that neither worker is left with a long one at the end.
_FIRST = ("test_debugging.py", "test_chaos.py", "test_launch.py", "test_elastic.py",
          "test_mesh.py", "test_browser.py", "test_magics.py", "test_lab_extension.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def first(item: pytest.Item) -> int:
        name = item.path.name
        return _FIRST.index(name) if name in _FIRST else len(_FIRST)

    items.sort(key=first)  # stable: the order within a file is kept


def session_procs(match: Callable[[list[str]], bool] = lambda cmd: True) -> dict[int, str]:
    """The live processes this test session started whose command line
    ``match``es (by default any: ranks, agents, kernels, browsers, the slurm
    and munge daemons): those whose environment carries this session's tag,
    but this process. pid -> its command line. (sshd's per-connection
    processes start with an empty environment: tests/engines.py ends them.)"""
    out = {}
    me = os.getpid()
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if p.pid == me or not match(cmd):  # (the command line first: it is cheaper)
                continue
            if p.environ().get("MONARCH_NB_TEST_SESSION") == SESSION_TAG:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out[p.pid] = " ".join(cmd)[:120]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _is_rank(cmd: list[str]) -> bool:
    return "monarch_nb.worker" in cmd or ("monarch_nb.cli" in cmd and "worker" in cmd)


def worker_pids() -> set[int]:
    """PIDs of the monarch_nb rank processes started by this test session."""
    return set(session_procs(_is_rank))


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02,
             what: str = "condition") -> object:
    """Poll ``predicate`` until it is truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _outlived(find: Callable[[], dict[int, str]], deadline: float) -> dict[int, str]:
    """What ``find`` still finds at ``deadline`` (waited for until then):
    killed, so the machine stays usable, and returned, to fail loudly."""
    left = find()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = find()
    for pid in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()
    return left


@pytest.fixture(scope="session", autouse=True)
def no_orphans() -> Iterator[None]:
    ranks_before = worker_pids()
    others = set(session_procs())  # (none, unless a helper was started at import)
    yield
    deadline = time.monotonic() + 10
    leaked = _outlived(lambda: {pid: cmd for pid, cmd in session_procs(_is_rank).items()
                                if pid not in ranks_before}, deadline)
    assert not leaked, f"rank processes outlived the test session: {sorted(leaked)}"
    # Nor anything else the tests started (a test engine's daemon, a kernel,
    # a browser)
    left = _outlived(lambda: {pid: cmd for pid, cmd in session_procs().items()
                              if pid not in others}, deadline + 10)
    assert not left, f"processes the tests started outlived the test session: {left}"


def _owned_by(meshes: list[Mesh]) -> set[int]:
    """PIDs of the processes (ranks and spares) of ``meshes`` still running."""
    pids: set[int] = set()
    for mesh in meshes:
        if mesh.running:
            sup = mesh._ctl.supervisor
            pids.update(p.pid for p in sup.procs.values())
            if sup.spare is not None:
                pids.add(sup.spare.pid)
            if sup.warm is not None:  # the warm process the ranks are forked from
                pids.add(sup.warm.pid)
    return pids


def _other_workers_kept_agent(pid: int) -> bool:
    """``pid`` is a kept mesh's agent (procs/keptagent.py) that the other
    pytest-xdist worker started: init adopted it, so its ranks' parent says
    nothing of who started them; its environment does."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return False
    try:
        agent = psutil.Process(pid)
        if "--serve-kept" not in agent.cmdline():
            return False
        return agent.environ().get("PYTEST_XDIST_WORKER", worker) != worker
    except psutil.Error:
        return False


@pytest.fixture(autouse=True)
def steady_network(request: pytest.FixtureRequest) -> Iterator[None]:
    """A browser test's chromium sees no namespace made or removed (engines.py)."""
    if request.node.get_closest_marker("browser") is None:
        yield
        return
    from .engines import steady_network as held

    with held():
        yield


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    """Each test checks for the rank processes it leaves behind: a rank this
    test started must be gone when it ends, unless it belongs to a mesh, a
    kernel or a launcher that a fixture started before the test (and that
    fixture stops). Runs after the test's own fixtures are torn down."""
    from monarch_nb import mesh as mesh_mod

    ranks_before = worker_pids()
    alive_before = set(psutil.pids())
    meshes = [m for m in mesh_mod._live_meshes if m.running]
    yield

    def leftovers() -> set[int]:
        found = worker_pids() - ranks_before
        # who owns what is read after the scan: a live mesh's spare forked
        # while the scan ran (it takes a while under load) is its mesh's by now
        owned = _owned_by(meshes)
        out = set()
        for pid in found - owned:
            try:
                parent = psutil.Process(pid).ppid()
            except psutil.NoSuchProcess:
                continue
            if parent != os.getpid() and parent != 1 and parent in alive_before:
                continue  # a fixture's kernel or launcher, still in use
            if _other_workers_kept_agent(parent):
                continue  # a kept mesh's rank started by the other pytest-xdist worker
            out.add(pid)
        return out

    deadline = time.monotonic() + 10
    leaked = leftovers()
    while leaked and time.monotonic() < deadline:  # one look decides: no second sample to race
        time.sleep(0.1)
        leaked = leftovers()
    about = []
    for pid in leaked:  # say what each one is, kill it so the next tests run, fail this one
        try:
            p = psutil.Process(pid)
            env = p.environ()
            mesh_ids = {m._ctl.mesh_id for m in mesh_mod._live_meshes}
            about.append(
                f"pid {pid}: parent {p.ppid()}, {p.status()}, up {time.time() - p.create_time():.1f} s, "
                f"{'a spare' if env.get('MONARCH_NB_SPARE') else 'a warm process' if env.get('MONARCH_NB_WARM') else 'rank ' + env.get('RANK', '?')}"
                f" incarnation {env.get('MONARCH_NB_INCARNATION', '?')}, mesh "
                f"{env.get('MONARCH_NB_MESH_ID', '?')} "
                f"({'live' if env.get('MONARCH_NB_MESH_ID') in mesh_ids else 'not a live mesh'})")
        except psutil.Error:
            about.append(f"pid {pid}: (gone while looked at)")
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    assert not leaked, f"this test left rank processes running: {sorted(leaked)}: {about}"


@pytest.fixture(scope="module")
def mesh4() -> Iterator[Mesh]:
    """A 4-rank CPU mesh shared by the tests of one module (start-up costs
    seconds: torch is imported by every rank)."""
    mesh = Mesh.start(n=4, backend="cpu")
    yield mesh
    pids = [p.pid for p in mesh._ctl.supervisor.procs.values()]
    mesh.stop()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture
def healthy(mesh4: Mesh) -> Mesh:
    """``mesh4``, checked to be fully alive (tests that kill ranks use their own mesh)."""
    assert all(row["state"] in ("ready", "busy") for row in mesh4.status()), mesh4.status()
    return mesh4
