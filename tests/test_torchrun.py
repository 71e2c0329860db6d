"""torchrun as a drop-in: flags, environment, the announced form, retry by
fact, the user's own process-group calls in cells, and the messages of issue 18.

Real processes throughout: the launcher and torchrun itself run a probe
script that prints its environment as JSON; the cell cases run through one
2-rank CPU mesh shared by the module (they leave it usable); the magics run
in a real IPython shell. The pure parts (flag mapping, refusals) start nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from monarch_nb import Mesh
from monarch_nb.errors import RankErrors, RemoteError, UsageError
from monarch_nb.launchopts import build_parser, line_prefix, logged, parse, plan, shown
from monarch_nb.ui.labcomm import lab_front_end

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
    import json, os, sys
    import torch.distributed as dist
    keep = ("RANK", "LOCAL_", "WORLD_SIZE", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_",
            "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k.startswith(keep)}
    print("PROBE " + json.dumps({"env": env, "argv": sys.argv,
                                 "elastic": dist.is_torchelastic_launched()}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 120, **env: str
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=_env(**env))


def _probes(out: str) -> dict[int, dict[str, Any]]:
    # torchrun's ranks share one stdout with no line discipline: two probes
    # can land on one line ("PROBE {...}PROBE {...}"), so each is decoded
    # where it starts, up to where its JSON ends.
    found = {}
    decoder = json.JSONDecoder()
    for piece in out.split("PROBE ")[1:]:
        data, _ = decoder.raw_decode(piece)
        found[int(data["env"]["RANK"])] = data
    return found


# -- pure: the flags ---------------------------------------------------------------------------
def test_every_torchrun_flag_is_known_in_both_spellings() -> None:
    from torch.distributed.run import get_args_parser

    ours = {opt for a in build_parser()._actions for opt in a.option_strings}
    theirs = {opt for a in get_args_parser()._actions for opt in a.option_strings}
    assert theirs - ours == set()


def _plan(*argv: str) -> Any:
    return plan(parse(build_parser(), list(argv)))


def test_torchrun_flags_map_onto_the_mesh() -> None:
    p = _plan("--standalone", "--nproc_per_node", "3", "--max-restarts=2", "--role", "trainer",
              "--rdzv-id", "ignored-with-standalone", "train.py", "--lr", "1")
    assert (p.mesh["n"], p.mesh["gpus_per_node"], p.mesh["launcher"]) == (3, 3, "local")
    assert p.mesh["restart_budget"] == 2
    env = dict(p.mesh["extra_env"])
    assert env["ROLE_NAME"] == "trainer" and env["TORCHELASTIC_MAX_RESTARTS"] == "2"
    assert env["TORCHELASTIC_RUN_ID"] != "ignored-with-standalone"  # as torchrun does
    assert dict(_plan("--rdzv_id", "job7", "x.py").mesh["extra_env"])["TORCHELASTIC_RUN_ID"] == "job7"
    # cpu: one rank per core on CPU ranks; -m and --no-python choose how the script runs
    cpu = _plan("--nproc-per-node", "cpu", "-m", "pkg.train")
    assert cpu.mesh["n"] == (os.cpu_count() or 1) and cpu.mesh["backend"] == "cpu"
    assert cpu.mode == "module" and _plan("--no_python", "prog").mode == "exec"
    two = _plan("--nnodes", "2:2", "--hosts", "a,b", "--nproc-per-node", "2", "x.py").mesh
    assert (two["n"], two["nodes"], two["gpus_per_node"], two["launcher"]) == (4, 2, 2, "ssh")
    assert "min_ranks" not in two and two["restart_group"]  # a fixed size: every rank
    join = _plan("--nnodes", "2", "--rdzv-endpoint", "10.0.0.5:29400", "x.py")
    assert (join.mesh["launcher"], join.mesh["bind"], join.mesh["master_addr"]) == \
        ("join", "10.0.0.5", "10.0.0.5")
    # moot here: accepted, said
    moot = _plan("--master-port", "29500", "--monitor-interval", "1", "--start-method", "fork",
                 "--rdzv-backend", "etcd", "--rdzv-conf", "join_timeout=30,foo=1", "x.py")
    assert moot.mesh["start_timeout"] == 30.0
    text = "\n".join(moot.notes)
    for flag in ("--master-port", "--monitor-interval", "--start-method fork",
                 "--rdzv-backend etcd", "--rdzv-conf foo"):
        assert flag in text
    # -r / -t / --local-ranks-filter decide what the console shows
    red = _plan("-r", "0:1,1:3", "--local-ranks-filter", "0,1", "x.py")
    assert red.log_dir is not None
    assert not shown(red, 0, "stdout") and shown(red, 0, "stderr")
    assert not shown(red, 1, "stderr") and not shown(red, 2, "stdout")


def test_pet_variables_are_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun reads every flag it is not given from PET_<FLAG> (argparse_util.env)
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.setenv("PET_DUPLICATE_STDOUT_FILTERS", "loss")
    p = _plan("x.py")
    assert (p.mesh["n"], p.mesh["restart_budget"]) == (3, 2)
    assert p.dup_filters["stdout"] == ["loss"]
    assert dict(p.mesh["extra_env"])["TORCHELASTIC_MAX_RESTARTS"] == "2"
    assert _plan("--nproc-per-node", "1", "x.py").mesh["n"] == 1  # the command line wins
    monkeypatch.setenv("PET_STANDALONE", "0")
    assert not parse(build_parser(), ["x.py"]).standalone
    monkeypatch.setenv("PET_STANDALONE", "yes")
    with pytest.raises(SystemExit):
        build_parser()


def test_torchrun_prefixes_are_accepted() -> None:
    # argparse's prefixes, as torchrun's parser takes them; the value is the flag's
    ns = parse(build_parser(), ["--standal", "--max-restart", "2", "--redirect", "3",
                                "--nproc-per", "2", "x.py", "--max-restart", "9"])
    assert (ns.standalone, ns.max_restarts, ns.redirects, ns.nproc_per_node) == \
        (True, 2, "3", "2")
    assert ns.script == "x.py" and ns.args == ["--max-restart", "9"]  # the script's own


def test_tee_wins_and_only_named_ranks_are_logged() -> None:
    both = _plan("-r", "3", "-t", "3", "x.py")  # torchrun: to the files and the console
    assert shown(both, 0, "stdout") and shown(both, 5, "stderr") and logged(both, 5)
    part = _plan("-r", "3", "-t", "0:1", "x.py")
    assert shown(part, 0, "stdout") and not shown(part, 0, "stderr")
    assert not shown(part, 1, "stdout")
    only0 = _plan("-r", "0:3", "x.py")
    assert logged(only0, 0) and not logged(only0, 1) and shown(only0, 1, "stdout")
    assert logged(_plan("--log-dir", "d", "x.py"), 3)  # --log-dir alone: every rank saved


def test_torchrun_defaults_follow_torchrun_flags() -> None:
    ours = _plan("x.py")  # no torchrun flag: monarch_nb's own defaults
    assert ours.mesh["n"] is None and "restart_budget" not in ours.mesh
    assert dict(ours.mesh["extra_env"])["TORCHELASTIC_MAX_RESTARTS"] == "5"
    theirs = _plan("--standalone", "x.py")  # torchrun: 1 rank per node, no restart
    assert (theirs.mesh["n"], theirs.mesh["restart_budget"]) == (1, 0)
    assert dict(theirs.mesh["extra_env"])["TORCHELASTIC_MAX_RESTARTS"] == "0"
    note = "\n".join(theirs.notes)
    assert "torchrun's defaults apply" in note and "--standalone" in note
    assert "--nproc-per-node 1" in note and "--max-restarts 0" in note
    # a dead rank's line names the setting, as given, and how to turn respawns on
    assert theirs.mesh["no_restarts_hint"] == ("--max-restarts 0 (torchrun's default with "
                                               "torchrun's flags); pass --max-restarts N")
    assert _plan("--max-restarts", "0", "x.py").mesh["no_restarts_hint"] == (
        "--max-restarts 0; pass --max-restarts N")
    assert "no_restarts_hint" not in _plan("--standalone", "--max-restarts", "2", "x.py").mesh
    assert _plan("--standalone", "-n", "2", "x.py").mesh["n"] == 2


def test_log_line_prefix_template(monkeypatch: pytest.MonkeyPatch) -> None:
    assert line_prefix(_plan("x.py"), 3, 1) is None
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${role_name}${rank}/${local_rank} $x]:")
    p = _plan("--role", "trainer", "x.py")
    assert line_prefix(p, 3, 1) == "[trainer3/1 $x]:"  # safe_substitute, as torchrun


TORCHRUN_STYLE = """
    import os, sys
    print("out", os.environ["RANK"], os.environ["WORLD_SIZE"],
          os.environ["TORCHELASTIC_MAX_RESTARTS"], flush=True)
    print("err", os.environ["RANK"], file=sys.stderr, flush=True)
"""


def test_torchrun_style_launch_from_pet_variables(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(textwrap.dedent(TORCHRUN_STYLE))
    res = _run([sys.executable, "-m", "monarch_nb.launch", "--backend", "cpu", "--standal",
                "--max-restart", "1", "--redirect", "3", "--tee", "0:1", "--log-dir", "logs",
                "--role", "trainer", "job.py"], tmp_path,
               PET_NPROC_PER_NODE="2", PET_RUN_PATH="1",
               TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="${role_name}-${rank}-${local_rank}> ")
    assert res.returncode == 0, res.stderr
    assert "trainer-0-0> out 0 2 1" in res.stdout  # local rank 0's stdout is tee'd
    console = res.stdout + res.stderr
    for hidden in ("out 1", "err 0", "err 1"):  # everything else goes to the files only
        assert hidden not in console, console
    logs = list((tmp_path / "logs").glob("*/rank*.log"))
    assert sorted(p.name for p in logs) == ["rank0.log", "rank1.log"]
    assert "err 1" in (logs[0].parent / "rank1.log").read_text()


@pytest.mark.parametrize(("argv", "says"), [
    (["--nnodes", "2:4", "--nproc-per-node", "2", "x.py"], "this machine is one node, fewer "
                                                             "than MIN=2"),
    (["--nnodes", "0:2", "x.py"], "at least 1 node, not 0"),
    (["--nnodes", "3:2", "--hosts", "a,b", "x.py"], "write --nnodes 2:3"),
    (["--nnodes", "a:b", "x.py"], "a range MIN:MAX (--nnodes 1:2)"),
    (["--nnodes", "1:2", "--hosts", "a,b", "--nproc-per-node", "2", "--min-ranks", "5", "x.py"],
     "--min-ranks 5: give a number of ranks from 1 to the 4"),
    (["-n", "2", "--min-ranks", "0", "x.py"], "--min-ranks 0"),
    (["--node-rank", "1", "x.py"], "monarch-nb worker --join"),
    (["--nnodes", "2", "x.py"], "--hosts H1,H2"),
    (["--standalone", "--nnodes", "2", "x.py"], "--standalone runs on one node"),
    (["--numa-binding", "node", "x.py"], "numactl"),
    (["--logs-specs", "x", "x.py"], "--log-dir"),
    (["-m", "--no-python", "x"], "--no-python"),
    (["--nproc-per-node", "xpu", "x.py"], "CUDA, ROCm or CPU"),
    (["--nproc-per-node", "gpu", "--backend", "auto", "x.py"], "no GPU"),
])
def test_refused_flags_say_what_to_use(argv: list[str], says: str) -> None:
    if "gpu" in argv:
        from monarch_nb.backends import resolve

        if resolve("auto").devices:
            pytest.skip("this machine has a GPU")
    with pytest.raises(UsageError) as info:
        _plan(*argv)
    assert says in str(info.value)


def test_announced_form_parsing() -> None:
    ns = parse(build_parser(), ["--backend=cpu", "train.py", "--nodes=1", "--lr", "0.1",
                                "--gpus-per-node", "2", "--", "--nodes", "9"])
    assert ns.taken == ["--nodes=1", "--gpus-per-node", "2"]
    assert ns.args == ["--lr", "0.1", "--nodes", "9"]
    assert (ns.nodes, ns.gpus_per_node, ns.backend) == (1, 2, "cpu")


# -- real launches -------------------------------------------------------------------------------
def test_environment_matches_torchrun(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(textwrap.dedent(PROBE))
    ours = _run([sys.executable, "-m", "monarch_nb.launch", "--standalone", "--nproc-per-node=2",
                 "--backend", "cpu", "probe.py", "a", "--b"], tmp_path)
    assert ours.returncode == 0, ours.stderr
    theirs = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=2", "probe.py", "a", "--b"], tmp_path)
    assert theirs.returncode == 0, theirs.stderr
    mine, ref = _probes(ours.stdout), _probes(theirs.stdout)
    assert sorted(mine) == sorted(ref) == [0, 1]
    for rank in (0, 1):
        a, b = mine[rank], ref[rank]
        assert a["elastic"] is b["elastic"] is True
        assert a["argv"] == b["argv"] == ["probe.py", "a", "--b"]
        # every variable torchrun sets is set (TORCH_NCCL_ASYNC_ERROR_HANDLING: NCCL's
        # own default is kept, see the README's table)
        assert set(b["env"]) - set(a["env"]) == set(), (a["env"], b["env"])
        same = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS")
        assert {k: a["env"][k] for k in same} == {k: b["env"][k] for k in same}
        assert a["env"]["TORCHELASTIC_RUN_ID"] and a["env"]["MASTER_PORT"].isdigit()
        assert a["env"]["TORCHELASTIC_RUN_ID"] == mine[0]["env"]["TORCHELASTIC_RUN_ID"]
    # torchrun's OMP notice, once
    assert ours.stderr.count("Setting OMP_NUM_THREADS environment variable") == 1


def test_announced_form_and_a_users_omp_setting(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(textwrap.dedent(PROBE) + "print('ARGS', sys.argv[1:])\n")
    res = _run([sys.executable, "-m", "monarch_nb.launch", "--backend=cpu", "probe.py",
                "--nodes=1", "--lr", "0.1", "--gpus-per-node=2", "--", "--nodes", "9"],
               tmp_path, OMP_NUM_THREADS="3")
    assert res.returncode == 0, res.stderr
    assert ("monarch_nb: taking --nodes=1 --gpus-per-node=2 after the script as launcher "
            "options; put them after `--` to pass them to the script") in res.stderr
    probes = _probes(res.stdout)
    assert sorted(probes) == [0, 1]
    assert all(p["env"]["OMP_NUM_THREADS"] == "3" for p in probes.values())  # never overridden
    assert "Setting OMP_NUM_THREADS" not in res.stderr
    assert "ARGS ['--lr', '0.1', '--nodes', '9']" in res.stdout


def test_a_main_that_exits_1_is_retried_after_a_peers_death(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import sys, time, torch, torch.distributed as dist
        import monarch_nb as mnb
        from monarch_nb import chaos

        def main():
            try:
                for step in range(12):
                    t = torch.ones(1)
                    dist.all_reduce(t)
                    time.sleep(0.05)
                    chaos.die_at(step, 4, rank=1)
                print("finished rank", mnb.rank(), "incarnation", mnb.incarnation())
            except Exception as exc:     # every error becomes an exit code
                print("main failed:", type(exc).__name__, file=sys.stderr)
                sys.exit(1)

        main()
        """))
    res = _run([sys.executable, "-m", "monarch_nb.launch", "--backend", "cpu", "-n", "2",
                "train.py"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "rank 1 died: killed by SIGKILL" in res.stderr
    # torchrun's restart: rank 0 is restarted with it, in a new process
    assert "rank 0 runs the script again in a new process" in res.stderr
    assert "[0] finished rank 0 incarnation 1" in res.stdout
    assert "[1] finished rank 1 incarnation 1" in res.stdout


@pytest.mark.parametrize(("flags", "says"), [
    (["--standalone", "--nproc-per-node", "2"],
     "--max-restarts 0 (torchrun's default with torchrun's flags); pass --max-restarts N"),
    (["-n", "2", "--max-restarts", "0"], "--max-restarts 0; pass --max-restarts N"),
])
def test_a_rank_not_respawned_by_max_restarts_0_says_so(tmp_path: Path, flags: list[str],
                                                         says: str) -> None:
    """With ``--max-restarts 0`` (torchrun's default once torchrun's flags are
    used) a dead rank is not respawned: its line says that, why, and how to
    turn respawns on, not that it "died 1 times ... Fix the cause" as if a
    restart budget were spent."""
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import time, torch, torch.distributed as dist
        from monarch_nb import chaos
        for step in range(200):
            dist.all_reduce(torch.ones(1))
            chaos.die_at(step, 3, rank=1)
            time.sleep(0.02)
        """))
    res = _run([sys.executable, "-m", "monarch_nb.launch", "--backend", "cpu", *flags,
                "train.py"], tmp_path)
    assert res.returncode != 0, res.stderr
    assert f"rank 1 died (SIGKILL); not respawned: {says}" in res.stderr, res.stderr[-3000:]
    assert "times within" not in res.stderr and "Fix the cause" not in res.stderr, res.stderr


# -- cells: the user's own process-group calls ------------------------------------------------
@pytest.fixture(scope="module")
def mesh2() -> Iterator[Mesh]:
    mesh = Mesh.start(n=2, backend="cpu")
    try:
        yield mesh
    finally:
        mesh.stop()


def _cell(mesh: Mesh, code: str, name: str | None = None) -> tuple[Any, str]:
    """Run a cell; its results and what the ranks printed."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
        try:
            res: Any = mesh.exec(textwrap.dedent(code), name=name)
        except RankErrors as exc:
            res = exc
    return res, buf.getvalue()


def test_init_process_group_in_a_cell_keeps_the_meshs_group(mesh2: Mesh) -> None:
    res, out = _cell(mesh2, """
        import datetime, torch, torch.distributed as dist
        dist.init_process_group("gloo")          # no "initialize ... twice!"
        dist.init_process_group(init_method="tcp://10.9.9.9:1234",
                                timeout=datetime.timedelta(seconds=77))
        t = torch.ones(1); dist.all_reduce(t)
        pg = dist.distributed_c10d._get_default_group()
        (t.item(), pg._get_backend(torch.device("cpu")).options._timeout.total_seconds())
        """)
    assert dict(res) == {0: (2.0, 77.0), 1: (2.0, 77.0)}, res
    assert "init_method='tcp://10.9.9.9:1234' is not used: the mesh's group" in out


def test_nccl_without_cuda_raises_as_torch_would(mesh2: Mesh) -> None:
    res, _ = _cell(mesh2, "import torch.distributed as dist\ndist.init_process_group('nccl')")
    assert isinstance(res, RankErrors)
    err = res.errors[0]
    assert isinstance(err, RemoteError) and err.type_name == "RuntimeError"
    assert "NCCL" in err.message  # "Distributed package doesn't have NCCL built in"


def test_destroy_in_a_cell_is_a_no_op_with_a_notice(mesh2: Mesh) -> None:
    res, out = _cell(mesh2, """
        import torch, torch.distributed as dist
        dist.destroy_process_group()
        t = torch.ones(1); dist.all_reduce(t)
        t.item()
        """)
    assert dict(res) == {0: 2.0, 1: 2.0}, res
    assert "destroy_process_group() left the mesh's group in place" in out


def test_argparse_in_a_cell_names_the_cell(mesh2: Mesh) -> None:
    res, _ = _cell(mesh2, """
        import argparse, sys
        p = argparse.ArgumentParser()
        p.add_argument("--steps", type=int, default=3)
        (sys.argv, p.parse_args([]).steps, p.prog)
        """, name="<mnb-cell-42>")
    assert dict(res)[0] == (["<mnb-cell-42>"], 3, "<mnb-cell-42>"), res
    res, out = _cell(mesh2, "argparse.ArgumentParser().parse_args(['--nope'])",
                     name="<mnb-cell-44>")
    assert isinstance(res, RankErrors) and "usage: <mnb-cell-44> [-h]" in out, out
    assert "worker.py" not in out
    res, _ = _cell(mesh2, "import sys\nsys.argv = ['train.py', '--lr', '1']")
    res, _ = _cell(mesh2, "import sys\nsys.argv", name="<mnb-cell-43>")
    assert dict(res)[0] == ["train.py", "--lr", "1"]  # the user's own argv is kept


def test_horovod_style_elastic_call(mesh2: Mesh) -> None:
    res, _ = _cell(mesh2, """
        import monarch_nb as mnb
        st = mnb.elastic.State(step=0)

        @mnb.elastic.run(st)
        def train(state, bump=1):
            state.step += bump
            return state.step

        (train(st), train(), train(st, bump=5))
        """)
    assert dict(res) == {0: (1, 2, 7), 1: (1, 2, 7)}, res


# -- messages --------------------------------------------------------------------------------
def test_rank_errors_str_does_not_repeat_its_name() -> None:
    err = RankErrors({1: RemoteError(1, "ValueError", "bad")}, {0: None})
    assert str(err).startswith("1 of 2 rank(s) failed")
    assert f"{type(err).__name__}: {err}".count("RankErrors") == 1
    assert err.render_lines()[0] == "RankErrors: 1 of 2 rank(s) failed"  # IPython's view


@pytest.fixture(scope="module")
def shell() -> Iterator[Any]:
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    assert ip is not None
    ip.run_line_magic("load_ext", "monarch_nb")
    yield ip
    ip.run_line_magic("unload_ext", "monarch_nb")


def _magic_error(shell: Any, line: str, capsys: Any) -> tuple[str, str]:
    res = shell.run_cell(line)
    out = capsys.readouterr()
    assert res.error_in_exec is not None, out
    err = res.error_in_exec
    return f"{type(err).__name__}: {err}", out.out + out.err


def test_magic_option_errors_are_clean(shell: Any, capsys: Any) -> None:
    text, printed = _magic_error(shell, "%monarch start -n two --backend cpu", capsys)
    assert text.startswith("UsageError: ") and "_ArgError" not in text + printed
    assert "invalid int value: 'two'" in text
    text, printed = _magic_error(shell, "%monarch start -n 0 --backend cpu", capsys)
    assert "n must be a positive number of ranks, not 0" in text
    assert "starting ranks" not in printed  # refused before saying anything starts


def test_push_names_the_variable_that_cannot_be_sent(shell: Any, mesh2: Mesh,
                                                     capsys: Any) -> None:
    from monarch_nb.ui import magics as magics_mod

    m = magics_mod._loaded[id(shell)]
    m.mesh = mesh2
    try:
        shell.run_cell("import threading\nlock = threading.Lock()\nok = 5")
        text, _ = _magic_error(shell, "%monarch push ok lock", capsys)
        assert "cannot push 'lock': a _thread.lock cannot be pickled" in text, text
        assert "argument 0" not in text
    finally:
        m.mesh = None  # the module's mesh is stopped by its fixture, not the magics


def test_headless_clients_get_no_comm_opened() -> None:
    class Kernel:  # what ipykernel.get_parent gives for a request
        def __init__(self, metadata: dict[str, Any]) -> None:
            self.metadata = metadata

        def get_parent(self, channel: str) -> dict[str, Any]:
            return {"metadata": self.metadata}

    saved = os.environ.pop("JPY_SESSION_NAME", None)
    try:
        assert not lab_front_end(Kernel({}))  # nbclient, nbconvert, papermill
        assert lab_front_end(Kernel({"deletedCells": [], "recordTiming": False,
                                     "cellId": "x"}))  # JupyterLab, Notebook 7
        os.environ["JPY_SESSION_NAME"] = "/nb/x.ipynb"  # a Jupyter server's kernel
        assert lab_front_end(Kernel({}))
    finally:
        os.environ.pop("JPY_SESSION_NAME", None)
        if saved is not None:
            os.environ["JPY_SESSION_NAME"] = saved


def test_gpu_check_skips_cleanly_without_a_gpu() -> None:
    from monarch_nb.backends import resolve

    if resolve("auto").devices:
        pytest.skip("this machine has a GPU: make gpu-check runs the real checks")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")],
                         capture_output=True, text=True, timeout=60, env=_env())
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("skipped: no GPU")


def test_nnodes_min_max_is_a_number_of_hosts_and_min_is_min_ranks() -> None:
    # several hosts: MAX nodes started, the run goes on with MIN nodes' ranks
    el = _plan("--nnodes", "1:2", "--nproc-per-node", "2", "--hosts", "a,b", "x.py")
    assert (el.mesh["n"], el.mesh["nodes"], el.mesh["min_ranks"]) == (4, 2, 2)
    assert any("at least 2 rank(s) (1 node(s) of 2) are left" in n for n in el.notes)
    # --min-ranks wins over MIN
    assert _plan("--nnodes", "1:2", "--nproc-per-node", "2", "--hosts", "a,b", "--min-ranks",
                 "3", "x.py").mesh["min_ranks"] == 3
    # one machine is one node: all its ranks (as torchrun's one node), or --min-ranks
    one = _plan("--nnodes", "1:2", "--nproc-per-node", "2", "x.py")
    assert (one.mesh["n"], one.mesh["nodes"], one.mesh["min_ranks"]) == (2, 1, 2)
    assert one.mesh["launcher"] == "local" and any("one machine" in n for n in one.notes)
    assert _plan("--standalone", "--nproc-per-node", "2", "--min-ranks", "1",
                 "x.py").mesh["min_ranks"] == 1
    # a SLURM allocation is several hosts
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_JOB_ID", "7")
        assert _plan("--nnodes", "2:3", "--nproc-per-node", "1", "x.py").mesh["min_ranks"] == 2
