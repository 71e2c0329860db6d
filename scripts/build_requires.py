"""pyproject.toml's build requirements, for builds without isolation.

``python scripts/build_requires.py [--editable]`` prints them one per line:
``build-system.requires``, and with ``--editable`` also what the build backend
asks for an editable install (PEP 660's ``get_requires_for_build_editable``:
hatchling's ``editables``; asked only once the backend is installed). ``make
venv`` installs them, then the package with ``--no-build-isolation``: pip's
isolated build would install jupyterlab a second time (~20 s).
``--missing``: those the running interpreter lacks, exit 1 if any (``make
wheel-check`` builds with this interpreter's packages). On Python 3.10
without tomli it cannot read them: it prints nothing, and ``--missing``
exits 1 (the caller then builds with isolation). Run from the repository root.
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        print("build requirements: cannot read pyproject.toml (no tomllib, no tomli)",
              file=sys.stderr)
        sys.exit(1 if "--missing" in sys.argv else 0)


def requires(editable: bool) -> list[str]:
    with open("pyproject.toml", "rb") as f:
        system: dict[str, Any] = tomllib.load(f)["build-system"]
    specs = list(system["requires"])
    if editable:
        try:
            backend = importlib.import_module(system["build-backend"])
        except ImportError:
            specs.append(system["build-backend"].split(".")[0])  # counted missing
        else:
            hook = getattr(backend, "get_requires_for_build_editable", None)
            specs += [s for s in (hook() if hook else []) if s not in specs]
    return specs


def missing(specs: list[str]) -> list[str]:
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a venv with nothing but pip: none of them is there
        return specs
    out = []
    for spec in specs:
        req = Requirement(spec)
        try:
            have = version(req.name)
        except PackageNotFoundError:
            out.append(spec)
            continue
        if not req.specifier.contains(have, prereleases=True):
            out.append(f"{spec} (have {have})")
    return out


def main(argv: list[str]) -> int:
    flags = set(argv[1:])
    unknown = flags - {"--editable", "--missing"}
    if unknown:
        print(f"build_requires.py: unknown {sorted(unknown)}; use --editable, --missing",
              file=sys.stderr)
        return 2
    specs = requires("--editable" in flags)
    if "--missing" in flags:
        lacking = missing(specs)
        print("build requirements:", "missing " + ", ".join(lacking) if lacking
              else "all installed")
        return 1 if lacking else 0
    print("\n".join(specs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
