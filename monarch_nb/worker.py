"""Entry point of a rank process: ``python -m monarch_nb.worker``.

The module name is what ``ps`` shows for every rank (and what spares and
launchers start); the worker itself is engine/loop.py.
"""

from monarch_nb.engine.loop import main

if __name__ == "__main__":
    main()
