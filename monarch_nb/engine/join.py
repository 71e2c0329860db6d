"""The remote side of a launch: ``monarch-nb worker [--join tcp://HOST:PORT]
--key-file FILE|-``.

Reads the rank's spec — one JSON object ``{"env": {...}}`` with its rank,
world, controller address and keys (launchers.rank_spec) — from a 0600 file
or from stdin (``-``: how the ssh and slurm launchers pass it, so that no key
is ever on a command line), puts it in the environment and becomes the rank
(worker.main). ``--join`` overrides the controller address, for a spec file
made elsewhere (Kubernetes secrets, a shared file system).

With ``-`` the rank keeps reading stdin after the spec: end of file means
the ssh / srun process on the controller's side is gone, and the rank exits
at once instead of waiting for the controller timeout.

Non-goals: choosing where ranks run (launchers.py), the rank itself (loop.py).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import threading
from collections.abc import Sequence
from typing import IO

from .. import config
from ..errors import UsageError


def read_spec(stream: IO[str]) -> dict[str, str]:
    line = stream.readline()
    if not line.strip():
        raise UsageError("no rank spec on stdin (expected one JSON line from the launcher)")
    return _env_of(json.loads(line))


def read_spec_file(path: str) -> dict[str, str]:
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"key file {path} is readable by others; chmod 600 it")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return _env_of(json.loads(text))
    except ValueError:
        raise UsageError(f"key file {path} is not a monarch_nb rank spec (JSON)") from None


def _env_of(spec: object) -> dict[str, str]:
    env = spec.get("env") if isinstance(spec, dict) else None
    if not isinstance(env, dict):
        raise UsageError('a rank spec is a JSON object {"env": {...}}')
    return {str(k): str(v) for k, v in env.items()}


def _exit_on_eof(stream: IO[str]) -> None:
    def watch() -> None:
        try:
            while stream.read(4096):
                pass
        except (OSError, ValueError):
            pass
        os._exit(3)  # the launcher's side is gone: no orphan on this host

    threading.Thread(target=watch, name="monarch-nb-stdin-watch", daemon=True).start()


def join_main(argv: Sequence[str] | None = None, prog: str = "monarch-nb worker") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Run one rank of a monarch_nb mesh.")
    p.add_argument("--join", metavar="tcp://HOST:PORT", default=None,
                   help="the controller's address (default: the one in the spec)")
    p.add_argument("--key-file", required=True, metavar="FILE",
                   help="0600 JSON rank spec with the mesh keys, or - for stdin")
    ns = p.parse_args(argv)
    try:
        env = read_spec(sys.stdin) if ns.key_file == "-" else read_spec_file(ns.key_file)
    except (UsageError, OSError, ValueError) as exc:
        sys.stderr.write(f"monarch-nb worker: {exc}\n")
        return 2
    if ns.join:
        if not ns.join.startswith("tcp://"):
            sys.stderr.write("monarch-nb worker: --join takes tcp://HOST:PORT\n")
            return 2
        env[config.ENV_CONTROLLER] = ns.join
    os.environ.update(env)
    if ns.key_file == "-":
        _exit_on_eof(sys.stdin)
    from .loop import main

    main()
    return 0


if __name__ == "__main__":
    sys.exit(join_main())
