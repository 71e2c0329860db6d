"""The dashboard in a real browser: JupyterLab started on localhost, Debian's
chromium driven headless by Playwright, a notebook that starts 4 ranks and
runs a logging loop. Asserts 4 tiles and a chart with points on the page,
and saves the screenshot the README shows (docs/_static/dashboard.png, with MNB_SCREENSHOTS=1).
The collectives badge and straggler marks the same way; a lost host's line
with the page script alone, fed what the widget sends for a real mesh.

Skipped only where chromium (or Playwright) is missing *and* this is not CI;
in CI (``CI=true``) it runs, and fails if it cannot.
"""

from __future__ import annotations

import os
import pathlib
import re
import time
from collections.abc import Iterator

import pytest

from .conftest import wait_for
from .lab_util import CHROMIUM, CHROMIUM_ARGS, ROOT, jupyter_lab, need_browser, screenshot_path

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

SCREENSHOT = screenshot_path("dashboard.png")

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


@pytest.fixture
def lab(tmp_path: pathlib.Path) -> Iterator[tuple[str, str]]:
    """A JupyterLab server on localhost with the notebook; yields (url, token)."""
    need_browser()
    with jupyter_lab(tmp_path, "dashboard.ipynb", CELLS) as server:
        yield server


def test_dashboard_in_jupyterlab(lab: tuple[str, str]) -> None:
    from playwright.sync_api import sync_playwright

    url, token = lab
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
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
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.locator(".mnb-dash").first.screenshot(path=str(SCREENSHOT))
            assert SCREENSHOT.stat().st_size > 10_000
            # the cells finish (the last one stops the mesh)
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(
                timeout=120_000)
            page.get_by_text("monarch_nb: stopped 4 ranks").wait_for(timeout=60_000)
        finally:
            browser.close()


BADGE_SHOT = screenshot_path("collectives-badge.png")

DESYNC = """\
%%monarch
import os, time, torch, torch.distributed as dist
import monarch_nb as mnb
for step in range(25):
    time.sleep(0.09 if mnb.rank() == 1 else 0.03)   # rank 1: 3x the work
    x = torch.ones(16)
    dist.all_reduce(x)
    mnb.log(step=step, loss=1.0 / (step + 1) + 0.02 * mnb.rank())
def stuck_here(flag):
    while not os.path.exists(flag):
        time.sleep(0.05)
if mnb.rank() == 2:
    stuck_here(FLAG)   # rank 2 skips the all_reduce below until the test lets it go
dist.all_reduce(x)
"""


def test_collectives_badge_and_straggler_mark_in_jupyterlab(tmp_path: pathlib.Path) -> None:
    """A desync while the cell blocks the kernel: the badge says which
    ranks wait in which collective and where the missing rank is; the
    straggler's tile is marked. Saves docs/_static/collectives-badge.png."""
    need_browser()
    from playwright.sync_api import sync_playwright

    flag = tmp_path / "go"
    cells = ["%load_ext monarch_nb\n%monarch start -n 3 --backend cpu",
             DESYNC.replace("FLAG", repr(str(flag))), "%monarch stop"]
    with jupyter_lab(tmp_path, "desync.ipynb", cells) as (url, token), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(f"{url}/lab/tree/desync.ipynb?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_function(
                "() => { const k = window.jupyterapp?.shell?.currentWidget?.sessionContext"
                "?.session?.kernel; return k && k.connectionStatus === 'connected' "
                "&& k.status === 'idle'; }", timeout=120_000)
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            badge = page.locator(".mnb-badge.on")
            try:
                badge.wait_for(timeout=180_000)
            except Exception:
                page.screenshot(path=str(ROOT / "browser-failure.png"))
                raise
            text = re.sub(r"<mnb-cell-\d+>", "<mnb-cell-N>", badge.inner_text())
            assert text.startswith("⚠ collectives: 1 finding\n"), text
            assert "ranks 0,1 wait in all_reduce #25 (<mnb-cell-N> line 13); rank 2 never " \
                   "entered it (its last was #24 all_reduce): it is in stuck_here " \
                   "(<mnb-cell-N> line 10): time.sleep(0.05)" in text, text
            slow = page.locator(".mnb-tile[data-rank='1'] .mnb-slow")
            slow.wait_for(timeout=30_000)
            assert slow.inner_text().startswith("slow "), slow.inner_text()
            assert page.locator(".mnb-slow").count() == 1
            BADGE_SHOT.parent.mkdir(parents=True, exist_ok=True)
            page.locator(".mnb-dash").first.screenshot(path=str(BADGE_SHOT))
            assert BADGE_SHOT.stat().st_size > 10_000
            flag.touch()  # rank 2 joins: the cell ends
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(
                timeout=120_000)
            page.get_by_text("monarch_nb: stopped 3 ranks").wait_for(timeout=60_000)
        finally:
            flag.touch()
            browser.close()


PAGE = """<!doctype html><html><body><script type="module">
import dash from "/dashboard.js";
// the widget host's side (anywidget): a model with a uid, custom messages in
const handlers = [];
const model = { get: (k) => (k === "uid" ? "u1" : null), on: (ev, fn) => handlers.push(fn),
                send: () => {} };
window.feed = (msg) => handlers.forEach((fn) => fn(msg));
dash.initialize({ model });
dash.render({ model, el: document.body });
window.ready = true;
</script></body></html>"""


def test_the_dashboard_names_a_lost_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real mesh across two "hosts" (agents over ``sh -c``) loses one; the
    feed the widget sends (dashfeed.Feed over mesh.status and events) is
    played into the page script (ui/static/dashboard.js) in chromium: one
    line names the host and its ranks above the tiles, gone once they are
    back on another host."""
    need_browser()
    from playwright.sync_api import sync_playwright

    from monarch_nb.ui.dashfeed import Feed

    from .test_agents import _agent_of, _lose, _start

    monkeypatch.setenv("MONARCH_NB_SSH", "sh -c")
    script = (ROOT / "monarch_nb" / "ui" / "static" / "dashboard.js").read_text()
    mesh = _start()
    try:
        feed = Feed(mesh.metrics, mesh.status, lambda: mesh.events)
        first = feed.next()
        _lose(_agent_of(mesh.run(os.getpid)[2]))
        wait_for(lambda: [s["state"] for s in mesh.status()][2:] == ["lost", "lost"], timeout=30,
                 what="ranks 2,3 lost with their host")
        lost = feed.next()
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.route("http://mnb.test/", lambda r: r.fulfill(
                    body=PAGE, content_type="text/html"))
                page.route("http://mnb.test/dashboard.js", lambda r: r.fulfill(
                    body=script, content_type="text/javascript"))
                page.goto("http://mnb.test/")
                page.wait_for_function("() => window.ready === true", timeout=30_000)
                page.evaluate("(m) => window.feed(m)", first)
                page.wait_for_selector(".mnb-tile[data-rank='3']", timeout=30_000)
                assert not page.is_visible(".mnb-hosts")
                page.evaluate("(m) => window.feed(m)", lost)
                page.wait_for_selector(".mnb-hosts.on", timeout=30_000)
                text = page.inner_text(".mnb-hosts")
                assert "host hB lost with rank 2,3" in text, text
                assert "mesh.add_hosts('HOST') gives the mesh a host for rank 2,3: they start there" \
                    in text, text
                assert page.get_attribute(".mnb-tile[data-rank='2']", "data-state") == "lost"
                mesh.add_hosts("hC")  # ranks 2,3 start there
                wait_for(lambda: all(s["state"] == "ready" for s in mesh.status()), timeout=90,
                         what="ranks 2,3 back on hC")
                page.evaluate("(m) => window.feed(m)", feed.next())
                page.wait_for_selector(".mnb-hosts:not(.on)", state="attached", timeout=30_000)
                assert not errors, errors
            finally:
                browser.close()
    finally:
        mesh.stop()
