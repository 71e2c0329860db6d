"""Entry point of a host agent: ``python -m monarch_nb.agent``.

One per host of a multi-host mesh, started by the ssh or SLURM launcher; it
starts and supervises that host's ranks (procs/hostagent.py).
"""

import sys

from monarch_nb.procs.hostagent import main

if __name__ == "__main__":
    sys.exit(main())
