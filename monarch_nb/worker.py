"""Entry point of a rank process: ``python -m monarch_nb.worker``.

The module name is what ``ps`` shows for every rank (and what spares and
launchers start); the worker itself is engine/worker.py.
"""

from monarch_nb.engine.worker import main

if __name__ == "__main__":
    main()
