"""pyproject.toml's ``build-system.requires``, for builds without isolation.

``python scripts/build_requires.py`` prints them one per line (``make venv``
installs them, then installs the package with ``--no-build-isolation``: pip's
isolated build would otherwise install jupyterlab a second time, ~20 s).
``--missing``: those the running interpreter lacks, exit 1 if any (``make
wheel-check`` builds with this interpreter's packages). On Python 3.10
without tomli it cannot read them: it prints nothing, and ``--missing``
exits 1 (the caller then builds with isolation).
Run from the repository root.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

try:
    import tomllib
except ImportError:  # Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        print("build requirements: cannot read pyproject.toml (no tomllib, no tomli)",
              file=sys.stderr)
        sys.exit(1 if sys.argv[1:] == ["--missing"] else 0)


def requires() -> list[str]:
    with open("pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["build-system"]["requires"])


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
    specs = requires()
    if argv[1:] == ["--missing"]:
        lacking = missing(specs)
        print("build requirements:", "missing " + ", ".join(lacking) if lacking
              else "all installed")
        return 1 if lacking else 0
    print("\n".join(specs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
