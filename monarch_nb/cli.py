"""The ``monarch-nb`` console script: a thin front end over launch.py and
worker.py.

    monarch-nb launch [options] script.py [args ...]     # = python -m monarch_nb.launch
    monarch-nb worker --join tcp://HOST:PORT --key-file FILE
    monarch-nb ls                                       # kept meshes (Mesh.list())
    monarch-nb stop NAME                                # stop a kept mesh for good

Non-goals: anything the Python API cannot do.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: monarch-nb COMMAND ...

commands:
  launch [options] SCRIPT [ARGS ...]   run SCRIPT on every rank of a supervised mesh
                                       (monarch-nb launch --help)
  worker --join tcp://HOST:PORT --key-file FILE
                                       join a running mesh by hand (Kubernetes, any host)
                                       (monarch-nb worker --help)
  ls                                   the kept meshes of this user on this machine
  stop NAME                            stop kept mesh NAME for good (its ranks and agent)
"""


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        sys.exit(0 if args else 2)
    command, rest = args[0], args[1:]
    if command == "launch":
        from .launch import run

        sys.exit(run(rest, prog="monarch-nb launch"))
    if command == "worker":
        from .engine.join import join_main

        sys.exit(join_main(rest, prog="monarch-nb worker"))
    if command == "ls":
        sys.exit(_ls())
    if command == "stop":
        if len(rest) != 1:
            sys.stderr.write("usage: monarch-nb stop NAME   (monarch-nb ls lists the names)\n")
            sys.exit(2)
        sys.exit(_stop(rest[0]))
    sys.stderr.write(f"monarch-nb: unknown command {command!r}\n{USAGE}")
    sys.exit(2)


def _ls() -> int:
    import time

    from .mesh import Mesh

    rows = Mesh.list()
    if not rows:
        print("no kept mesh (start one with %monarch start --name NAME --keep-alive 30m)")
        return 0
    print(f"{'NAME':<20} {'RANKS':>5}  {'HOSTS':<16} {'STARTED':<19}  STATE")
    for row in rows:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["started"]))
        state = (f"attached: {row['attached']}" if row["attached"] else
                 f"detached, lease left {row['lease_left']:.0f} s")
        print(f"{row['name']:<20} {row['ranks']:>5}  {','.join(row['hosts']):<16} "
              f"{started:<19}  {state}")
    return 0


def _stop(name: str) -> int:
    from .errors import MonarchError
    from .mesh import Mesh

    try:
        mesh = Mesh.attach(name, force=True)
    except MonarchError as exc:
        sys.stderr.write(f"monarch-nb stop: {exc}\n")
        return 1
    n = mesh.world_size
    mesh.stop()
    print(f"stopped kept mesh {name!r} ({n} ranks)")
    return 0


if __name__ == "__main__":
    main()
