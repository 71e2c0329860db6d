"""The JupyterLab extension's unit tests (jest, extension/test/), run from
pytest so that `make test` and CI run them. They test the pure model (status
text, red state, panel rows, message handling) without a browser.

Needs node and extension/node_modules (made by the package build's
`npm install`: `make venv`); skipped outside CI when they are missing.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

EXT = pathlib.Path(__file__).resolve().parent.parent / "extension"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.mark.timeout(180)
def test_extension_jest_suite() -> None:
    npm = shutil.which("npm")
    missing = [what for what, ok in (("npm", npm), ("extension/node_modules (make venv)",
                                                   (EXT / "node_modules" / ".bin" / "jest").exists()))
               if not ok]
    if missing and not IN_CI:
        pytest.skip("the extension's unit tests need " + ", ".join(missing))
    assert not missing, "in CI the extension's unit tests must run; missing: " + ", ".join(missing)
    proc = subprocess.run([str(npm), "test", "--silent", "--", "--ci"], cwd=EXT,
                          capture_output=True, text=True, timeout=170)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "failed" not in out.split("Tests:")[-1].split("\n")[0], out
