"""The dashboard in a real browser: JupyterLab started on localhost, Debian's
chromium driven headless by Playwright, a notebook that starts 4 ranks and
runs a logging loop. Asserts 4 tiles and a chart with points on the page,
and saves the screenshot the README shows (docs/dashboard.png).

Skipped only where chromium (or Playwright) is missing *and* this is not CI;
in CI (``CI=true``) it runs, and fails if it cannot.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

CHROMIUM = "/usr/bin/chromium"
ROOT = pathlib.Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "docs" / "dashboard.png"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

CELLS = [
    "%load_ext monarch_nb\n%monarch start -n 4 --backend cpu",
    "%%monarch\nimport math, random, time\nimport monarch_nb as mnb\n"
    "random.seed(mnb.rank())\n"
    "for step in range(400):\n"
    "    loss = 2.0 * math.exp(-step / 80) + 0.1 * mnb.rank() + random.random() * 0.05\n"
    "    mnb.log(step=step, loss=loss, lr=1e-3 * (1 - step / 400))\n"
    "    time.sleep(0.05)",
    "%monarch stop",
]


def _need_browser() -> None:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def lab(tmp_path: pathlib.Path) -> Iterator[tuple[str, str]]:
    """A JupyterLab server on localhost serving ``tmp_path``; yields (url, token)."""
    _need_browser()
    nb = {
        "cells": [{"cell_type": "code", "metadata": {}, "source": c, "outputs": [],
                   "execution_count": None} for c in CELLS],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    root = tmp_path / "nb"
    root.mkdir()
    (root / "dashboard.ipynb").write_text(json.dumps(nb))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR"):  # no user settings or workspaces
        env[var] = str(tmp_path / var.lower())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    log = open(tmp_path / "lab.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
         f"--port={port}", "--ip=127.0.0.1", f"--ServerApp.token={token}",
         f"--ServerApp.root_dir={root}", "--LabApp.news_url=", "--LabApp.expose_app_in_browser=True",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "lab.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not start in 90 s"
                time.sleep(0.25)
        yield url, token
    finally:
        proc.terminate()  # the kernel goes with the server; its ranks with the kernel
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_dashboard_in_jupyterlab(lab: tuple[str, str]) -> None:
    from playwright.sync_api import sync_playwright

    url, token = lab
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.goto(f"{url}/lab/tree/dashboard.ipynb?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            # wait for the kernel to be connected and idle, then Run All Cells
            page.wait_for_function(
                "() => { const k = window.jupyterapp?.shell?.currentWidget?.sessionContext"
                "?.session?.kernel; return k && k.connectionStatus === 'connected' "
                "&& k.status === 'idle'; }", timeout=120_000)
            page.locator(".jp-Notebook .jp-Cell").first.click()
            # (not awaited: the command's promise resolves when every cell finished)
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")

            tiles = page.locator(".mnb-tile")
            try:
                tiles.nth(3).wait_for(timeout=180_000)  # 4 ranks started, the widget rendered
            except Exception:
                page.screenshot(path=str(ROOT / "browser-failure.png"))
                outputs = page.locator(".jp-OutputArea").all_inner_texts()
                raise AssertionError(f"no 4 tiles; outputs: {outputs}\nconsole:\n"
                                     + "\n".join(console[-40:])) from None
            assert tiles.count() == 4
            canvas = page.locator("canvas.mnb-chart")

            def points() -> int:
                return int(canvas.get_attribute("data-points") or 0)

            deadline = time.monotonic() + 120
            while points() < 4 * 80:  # the logging cell is running: points keep coming
                assert time.monotonic() < deadline, f"chart has {points()} points"
                time.sleep(0.25)
            first = points()
            states = [tiles.nth(i).get_attribute("data-state") for i in range(4)]
            assert states == ["busy"] * 4, states
            assert canvas.get_attribute("data-lines") == "4"
            assert "loss" in page.locator(".mnb-dash select").inner_text()
            time.sleep(1.0)
            assert points() > first  # still moving while the cell blocks the kernel
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.locator(".mnb-dash").first.screenshot(path=str(SCREENSHOT))
            assert SCREENSHOT.stat().st_size > 10_000
            # the cells finish (the last one stops the mesh)
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(
                timeout=120_000)
            page.get_by_text("monarch_nb: stopped 4 ranks").wait_for(timeout=60_000)
        finally:
            browser.close()
