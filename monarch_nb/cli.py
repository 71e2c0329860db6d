"""The ``monarch-nb`` console script: a thin front end over launch.py and
worker.py.

    monarch-nb launch [options] script.py [args ...]     # = python -m monarch_nb.launch
    monarch-nb worker --join tcp://HOST:PORT --key-file FILE

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
    sys.stderr.write(f"monarch-nb: unknown command {command!r}\n{USAGE}")
    sys.exit(2)


if __name__ == "__main__":
    main()
