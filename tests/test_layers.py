"""The package's layering at run time: a rank process loads only the rank side
(the contracts in pyproject.toml check the imports statically; these check what
a real rank has in ``sys.modules``), and the package root is still the user's
entry point with the controller-side names loaded on first use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import monarch_nb as mnb
from monarch_nb import Mesh

from .conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent
# What a rank must never load: the controller, the facade, the front ends, the launcher.
CONTROLLER_SIDE = ("monarch_nb.controller", "monarch_nb.mesh", "monarch_nb.ui",
                   "monarch_nb.launch", "monarch_nb.cli", "monarch_nb.launchopts")


# The probe a rank runs. Made in a namespace of its own so that cloudpickle sends
# it by value: by reference, the rank would import this test module, which
# imports the controller itself.
_PROBE: dict[str, object] = {"__name__": "__main__"}
exec("def loaded():\n"
     "    import sys\n"
     "    return sorted(m for m in sys.modules if m.startswith('monarch_nb'))\n", _PROBE)
_loaded = _PROBE["loaded"]


def _controller_side(modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith(CONTROLLER_SIDE)]


def _python(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return out.split()


def test_live_ranks_load_no_controller_module(mesh4: Mesh) -> None:
    per_rank = mesh4.run(_loaded)
    assert sorted(per_rank) == [0, 1, 2, 3]
    for rank, modules in per_rank.items():
        assert "monarch_nb.engine.loop" in modules, modules  # the probe does see the rank side
        assert _controller_side(modules) == [], (rank, _controller_side(modules))


def test_a_respawned_rank_loads_no_controller_module(mesh4: Mesh) -> None:
    before = mesh4.status()[1]["incarnation"]
    mesh4.restart(1)
    wait_for(lambda: mesh4.status()[1]["incarnation"] > before
             and mesh4.status()[1]["state"] in ("ready", "busy"), timeout=60)
    modules = mesh4[1].run(_loaded)[1]
    assert "monarch_nb.engine.loop" in modules
    assert _controller_side(modules) == []


def test_rank_entry_point_imports_only_the_rank_side() -> None:
    modules = _python("import sys, monarch_nb.worker\n"
                      "print(*sorted(m for m in sys.modules if m.startswith('monarch_nb')))")
    assert "monarch_nb.engine.loop" in modules
    assert _controller_side(modules) == []
    # and the spare's and --join's entry points
    for entry in ("monarch_nb.engine.spare", "monarch_nb.engine.join", "monarch_nb.engine.script"):
        modules = _python(f"import sys, {entry}\n"
                          "print(*sorted(m for m in sys.modules if m.startswith('monarch_nb')))")
        assert entry in modules
        assert _controller_side(modules) == [], (entry, _controller_side(modules))


def test_package_root_is_still_the_entry_point() -> None:
    # A fresh interpreter: the root alone loads no controller module ...
    modules = _python("import sys, monarch_nb\n"
                      "print(*sorted(m for m in sys.modules if m.startswith('monarch_nb')))")
    assert _controller_side(modules) == []
    # ... and every public name still resolves, the lazy ones on first use.
    names = _python("import sys, monarch_nb as mnb\n"
                    "from monarch_nb import Mesh, SubMesh, RankResults\n"
                    "print('monarch_nb.mesh' in sys.modules, Mesh.__module__, "
                    "SubMesh.__name__, RankResults.__name__)")
    assert names == ["True", "monarch_nb.mesh", "SubMesh", "RankResults"]
    for name in mnb.__all__:
        assert getattr(mnb, name) is not None, name
        assert name in dir(mnb), name
    assert mnb.Mesh is Mesh
    assert callable(mnb.load_ipython_extension)
    assert mnb.rank is not None and mnb.elastic is not None and mnb.chaos is not None


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        mnb.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("monarch_nb.NoSuchThing resolved")


def test_started_mesh_is_stopped_at_exit() -> None:
    """The atexit stop moved from the package root to where a mesh is made: a
    script that starts a mesh and just ends leaves no rank behind."""
    pids = _python("import monarch_nb as mnb\n"
                   "mesh = mnb.Mesh.start(n=2, backend='cpu')\n"
                   "print(*[p.pid for p in mesh._ctl.supervisor.procs.values()])")
    assert len(pids) == 2
    import psutil

    def gone() -> bool:
        return all(not psutil.pid_exists(int(p)) or psutil.Process(int(p)).status()
                   == psutil.STATUS_ZOMBIE for p in pids)

    wait_for(gone, timeout=30)
