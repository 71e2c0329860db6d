"""A JupyterLab server and headless chromium for the real-browser tests
(tests/test_browser.py, tests/test_lab_extension.py).

The browser tests are skipped only where chromium, Playwright or JupyterLab is
missing *and* this is not CI; in CI (``CI=true``) they run, and fail if they
cannot.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
ROOT = pathlib.Path(__file__).resolve().parent.parent


def screenshot_path(name: str) -> pathlib.Path:
    """Where a browser test saves its screenshot: over the README's image in
    docs/_static/ (the site's pictures) when ``MNB_SCREENSHOTS=1``, else in a temporary folder, so that a
    test run leaves the checkout as it found it."""
    if os.environ.get("MNB_SCREENSHOTS") == "1":
        return ROOT / "docs" / "_static" / name
    return pathlib.Path(tempfile.gettempdir()) / "mnb-screenshots" / name
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need_browser() -> None:
    missing = []
    if not os.path.exists(CHROMIUM):
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("playwright (pip install playwright)")
    if shutil.which("jupyter-lab", path=os.path.dirname(sys.executable)) is None:
        missing.append("jupyterlab (pip install jupyterlab)")
    if missing and not IN_CI:
        pytest.skip("browser test needs " + ", ".join(missing))
    assert not missing, "in CI the browser test must run; missing: " + ", ".join(missing)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def notebook(cells: list[str]) -> dict[str, Any]:
    return {
        "cells": [{"cell_type": "code", "metadata": {}, "source": c, "outputs": [],
                   "execution_count": None} for c in cells],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }


@contextlib.contextmanager
def jupyter_lab(tmp_path: pathlib.Path, name: str, cells: list[str],
                env_extra: dict[str, str] | None = None,
                settings: dict[str, dict[str, Any]] | None = None) -> Iterator[tuple[str, str]]:
    """A JupyterLab server on localhost serving one notebook ``name`` made of
    ``cells``, without workspaces and without user settings but ``settings``
    (plugin id -> its values, as Settings > Settings Editor would save them);
    yields (url, token) and stops the server (the kernel goes with it; its
    ranks with the kernel)."""
    root = tmp_path / "nb"
    root.mkdir()
    (root / name).write_text(json.dumps(notebook(cells)))
    token = secrets.token_hex(16)
    env = dict(os.environ)
    for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR"):
        env[var] = str(tmp_path / var.lower())
    for plugin, values in (settings or {}).items():
        package, _, part = plugin.partition(":")
        path = tmp_path / "jupyterlab_settings_dir" / package / f"{part}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(env_extra or {})
    log_path = tmp_path / "lab.log"
    log = open(log_path, "wb")
    proc: subprocess.Popen[bytes] | None = None
    try:
        # free_port() only finds a port free *now*: another test's process may
        # take it before the server binds it. The server must not quietly move
        # to the next port (port_retries=0: it exits instead); then start it
        # again on another one.
        for _ in range(5):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
                 f"--port={port}", "--ServerApp.port_retries=0", "--ip=127.0.0.1",
                 f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}",
                 "--LabApp.news_url=", "--LabApp.expose_app_in_browser=True",
                 "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 90
            while proc.poll() is None:
                try:
                    urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                    break
                except OSError:
                    assert time.monotonic() < deadline, (
                        "JupyterLab did not start in 90 s:\n" + log_path.read_text()[-3000:])
                    time.sleep(0.25)  # polling the server's status until it answers
            if proc.poll() is None:
                break
            text = log_path.read_text()
            assert "already in use" in text, text[-3000:]  # any other exit is a failure
        else:
            raise AssertionError("JupyterLab found no free port in 5 tries")
        yield url, token
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
