"""Two checks of monarch_nb's import graph that import-linter does not make.

1. No import cycle at all, lazy (function-level) and ``TYPE_CHECKING`` imports
   included: grimp's graph holds every ``import`` statement wherever it sits, and
   a strongly connected component of more than one module is a cycle.
2. Every module of monarch_nb is in at least one import-linter contract (named,
   or under a package named, as a layer, a source module or an independent
   module in pyproject.toml's ``[tool.importlinter]``).

Run from the repository root (``make lint`` does): exit 0, or 1 with the cycles
and the uncovered modules listed.
"""

from __future__ import annotations

import pathlib
import sys

import grimp

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = "monarch_nb"


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan,
    iterative), each sorted; a module importing itself counts too."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            targets = edges[node]
            if i < len(targets):
                work.append((node, i + 1))
                nxt = targets[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1 or node in edges[node]:
                    found.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def contract_modules(pyproject: pathlib.Path) -> set[str]:
    """The modules and packages each contract is about."""
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    named: set[str] = set()
    for contract in config.get("contracts", []):
        if contract.get("ignore_imports"):
            raise SystemExit(f"contract {contract['name']!r} has ignore_imports: none allowed")
        for key in ("layers", "source_modules", "modules"):
            for entry in contract.get(key, []):
                named.update(part.strip().strip("()") for part in entry.split("|"))
    return named


def uncovered(modules: set[str], named: set[str]) -> list[str]:
    def covered(module: str) -> bool:
        return any(module == n or module.startswith(n + ".") for n in named)

    # A package's __init__ is the package itself: covered if any contract names
    # it or something inside it.
    return sorted(m for m in modules if m != ROOT and not covered(m)
                  and not any(n.startswith(m + ".") for n in named))


def main() -> int:
    root = pathlib.Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    graph = grimp.build_graph(ROOT, include_external_packages=False)
    bad = False
    for comp in cycles(graph):
        bad = True
        print("import cycle: " + " <-> ".join(comp))
        for a in comp:
            for b in sorted(graph.find_modules_directly_imported_by(a) & set(comp)):
                lines = graph.get_import_details(importer=a, imported=b)
                where = ", ".join(f"line {d['line_number']}" for d in lines)
                print(f"    {a} -> {b} ({where})")
    missing = uncovered(set(graph.modules), contract_modules(root / "pyproject.toml"))
    for m in missing:
        bad = True
        print(f"in no import-linter contract: {m} (add it to one in pyproject.toml)")
    if not bad:
        print(f"check_cycles: {len(graph.modules)} modules, no import cycle "
              "(lazy imports included), every module in a contract")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
