#!/usr/bin/env python3
"""Execute a notebook headless through a real IPython kernel and print it.

Used by ``make demo``. Each cell's source is printed before it runs, then its
text outputs (stream text, ``text/plain`` results and displays, error
tracebacks). The kernel is always the interpreter running this script, so
``.venv/bin/python scripts/run_notebook.py nb.ipynb`` runs the notebook in the
venv whatever kernelspecs the machine has installed.

Exit status: 0 when every cell ran; 1 when a cell raised (cells tagged
``raises-exception`` are expected to raise, and it is a failure when they do
not), the kernel died, or a cell timed out. Nothing is written back to the
notebook file.

Non-goals: rendering HTML or widgets (their ``text/plain`` fallback is shown).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

KERNEL_NAME = "monarch-nb-run"
EXPECT_TAG = "raises-exception"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _clean(text: str, color: bool) -> str:
    return text if color else _ANSI.sub("", text)


def _rule(title: str) -> str:
    return f"---- {title} " + "-" * max(4, 72 - len(title))


def _print_outputs(outputs: list[dict[str, Any]], color: bool) -> None:
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            # stderr goes to stdout too, so the two keep their order in a log.
            text = _clean(out.get("text", ""), color)
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            if "text/plain" in data:
                print(_clean(data["text/plain"], color))
            else:
                print(f"[{kind}: {', '.join(sorted(data)) or 'empty'} not shown]")
        elif kind == "error":
            print(_clean("\n".join(out.get("traceback", [])), color))
    sys.stdout.flush()


def _local_kernel(kernel_dir: Path) -> AsyncKernelManager:
    """A KernelManager whose kernel is this very interpreter (sys.executable)."""
    spec_dir = kernel_dir / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(kernel_dir)])
    # IPC sockets in our private temp dir: no TCP port for other local users to reach.
    return AsyncKernelManager(
        kernel_name=KERNEL_NAME, kernel_spec_manager=ksm,
        transport="ipc", ip=str(kernel_dir / "ipc"),
    )


def run(path: Path, timeout: int, startup_timeout: int, color: bool) -> int:
    nb = nbformat.read(path, as_version=4)
    unraised: list[int] = []

    def on_start(cell: Any, cell_index: int) -> None:
        print(_rule(f"[{cell_index}] {cell.cell_type}"))
        print(cell.source)
        sys.stdout.flush()

    def on_executed(cell: Any, cell_index: int, execute_reply: dict[str, Any]) -> None:
        if cell.outputs:
            print(_rule(f"[{cell_index}] output"))
            _print_outputs(cell.outputs, color)
        expected = EXPECT_TAG in cell.metadata.get("tags", [])
        if expected and execute_reply["content"]["status"] != "error":
            unraised.append(cell_index)

    with tempfile.TemporaryDirectory(prefix="mnb-kernels-") as kernel_dir:
        client = NotebookClient(
            nb,
            km=_local_kernel(Path(kernel_dir)),
            timeout=timeout,
            startup_timeout=startup_timeout,
            resources={"metadata": {"path": str(path.parent.resolve())}},
            on_cell_start=on_start,
            on_cell_executed=on_executed,
        )
        try:
            # nbclient leaves a kernel it did not create running unless told otherwise.
            client.execute(cleanup_kc=True)
        except CellExecutionError as exc:
            print(f"\nFAILED: a cell raised: {exc.ename}: {exc.evalue}", file=sys.stderr)
            return 1
        except (CellTimeoutError, DeadKernelError) as exc:
            print(f"\nFAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    if unraised:
        cells = ", ".join(map(str, unraised))
        print(f"\nFAILED: cells tagged {EXPECT_TAG!r} did not raise: {cells}", file=sys.stderr)
        return 1
    print(f"\nOK: {path} ran {client.code_cells_executed} code cells")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebook", type=Path, help="path to the .ipynb file")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell (300)")
    parser.add_argument(
        "--startup-timeout", type=int, default=120, help="seconds for the kernel to start (120)"
    )
    parser.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto",
        help="keep ANSI colours in tracebacks (auto: when stdout is a terminal)",
    )
    args = parser.parse_args(argv)
    if not args.notebook.is_file():
        parser.error(f"no such notebook: {args.notebook}")
    color = args.color == "always" or (
        args.color == "auto" and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    )
    return run(args.notebook, args.timeout, args.startup_timeout, color)


if __name__ == "__main__":
    sys.exit(main())
