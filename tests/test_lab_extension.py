"""The JupyterLab extension (extension/) in a real browser: JupyterLab started
on localhost with the built extension, Debian's chromium driven headless by
Playwright. A notebook starts 4 ranks; the status bar shows "mesh 4/4 ranks
· cpu", goes to 3/4 (red) around ``%monarch kill 1`` and back to 4/4 after
the respawn, all while a cell keeps the kernel busy; a reloaded page finds the mesh again; the side panel lists the ranks, its stacks button shows where
they are, its restart button replaces a rank; ``%monarch stop`` leaves
"mesh: none". Everything the page shows came over the comm, not from
executing code. Saves the screenshot the README shows (docs/_static/lab-extension.png, with MNB_SCREENSHOTS=1).

The extension is served from this checkout's build (monarch_nb/labextension,
made by the package build: `make venv`, or `npm run build` in extension/)
through a JUPYTER_PATH entry, so an older copy installed in the venv cannot
shadow it. Skipped only outside CI when chromium, Playwright or the build is
missing; in CI (``CI=true``) it runs, and fails if it cannot.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Iterator

import pytest

from .conftest import wait_for, worker_pids
from .lab_util import (
    CHROMIUM,
    CHROMIUM_ARGS,
    IN_CI,
    ROOT,
    jupyter_lab,
    need_browser,
    screenshot_path,
)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

BUILD = ROOT / "monarch_nb" / "labextension"
SCREENSHOT = screenshot_path("lab-extension.png")
CELLS = [
    "%load_ext monarch_nb\n%monarch start -n 4 --backend cpu --no-dashboard",
    # a busy kernel: the kill and the end of the cell wait for the test's go
    "import os, time\n"
    "def wait_for_go(name):\n"
    "    t0 = time.monotonic()\n"
    "    while not os.path.exists(os.path.join(GO, name)) and time.monotonic() - t0 < 120:\n"
    "        time.sleep(0.05)\n"
    "wait_for_go('kill')\n"
    "%monarch kill 1\n"
    "wait_for_go('end')",
    "%monarch stop",
]
# Every text the status item shows, recorded in the page as it changes (a
# respawn is quick: polling from here could miss the 3/4).
RECORD = """() => {
  window.__mnbSeen = [];
  const item = document.querySelector('.mnb-lab-status');
  const note = () => window.__mnbSeen.push(
      [item.textContent, item.classList.contains('mnb-lab-alert')]);
  new MutationObserver(note).observe(item, {childList: true, characterData: true,
                                            subtree: true, attributes: true});
  note();
}"""


def _need_build() -> None:
    if not (BUILD / "static" / "style.js").exists():
        msg = f"the extension is not built ({BUILD}); run `make venv` or `npm run build` in extension/"
        if not IN_CI:
            pytest.skip(msg)
        raise AssertionError(msg)


@pytest.fixture
def lab(tmp_path: pathlib.Path) -> Iterator[tuple[str, str, pathlib.Path]]:
    need_browser()
    _need_build()
    data = tmp_path / "data" / "labextensions"
    data.mkdir(parents=True)
    (data / "monarch-nb-lab").symlink_to(BUILD)
    path = os.pathsep.join(p for p in (str(tmp_path / "data"), os.environ.get("JUPYTER_PATH", "")) if p)
    cells = [c.replace("GO", repr(str(tmp_path))) for c in CELLS]
    with jupyter_lab(tmp_path, "mesh.ipynb", cells, {"JUPYTER_PATH": path}) as (url, token):
        yield url, token, tmp_path


def test_status_bar_and_panel(lab: tuple[str, str, pathlib.Path]) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, token, go = lab
    before = worker_pids()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        console: list[str] = []
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))

        def run_cell(i: int) -> None:
            page.evaluate("(i) => { const nb = window.jupyterapp.shell.currentWidget.content;"
                          " nb.activeCellIndex = i;"
                          " window.jupyterapp.commands.execute('notebook:run-cell'); }", i)

        try:
            page.goto(f"{url}/lab/tree/mesh.ipynb?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_function(
                "() => { const k = window.jupyterapp?.shell?.currentWidget?.sessionContext"
                "?.session?.kernel; return k && k.connectionStatus === 'connected' "
                "&& k.status === 'idle'; }", timeout=120_000)
            status = page.locator(".mnb-lab-status")
            status.wait_for(state="attached", timeout=30_000)
            expect(status).to_be_hidden()  # no monarch_nb in the kernel yet
            page.evaluate(RECORD)

            # cell 1 keeps the kernel busy throughout: the page's own comm
            # requests wait behind it, the status bar must not
            run_cell(0)
            run_cell(1)
            expect(status).to_have_text("mesh 4/4 ranks · cpu", timeout=180_000)
            expect(status).not_to_have_class(re.compile("mnb-lab-alert"))
            (go / "kill").touch()  # %monarch kill 1: down and red, then respawned
            page.wait_for_function(
                "() => window.__mnbSeen.some(([t, red]) => t === 'mesh 3/4 ranks · cpu' && red)",
                timeout=60_000)
            expect(status).to_have_text("mesh 4/4 ranks · cpu", timeout=60_000)
            expect(status).not_to_have_class(re.compile("mnb-lab-alert"))
            assert page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext"
                                 ".session.kernel.status") == "busy"
            (go / "end").touch()
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(
                timeout=60_000)

            # a page opened after %load_ext opens the comm itself
            page.reload(timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            expect(status).to_have_text("mesh 4/4 ranks · cpu", timeout=60_000)

            status.click()  # opens the side panel
            panel = page.locator(".mnb-lab-panel")
            expect(panel.locator("tr.mnb-lab-rank")).to_have_count(4, timeout=30_000)
            row1 = panel.locator("tr.mnb-lab-rank[data-rank='1']")
            expect(row1.locator("td").nth(2)).to_have_text("1")  # incarnation
            expect(row1.locator("td").nth(3)).to_have_text("1")  # restarts
            expect(row1.locator("td").nth(4)).to_have_text(re.compile(r"\d+\.\d s"))  # heartbeat

            panel.locator(".mnb-lab-stacks-button").click()
            expect(panel.locator("pre.mnb-lab-stacks")).to_contain_text("ranks 0-3", timeout=60_000)

            row2 = panel.locator("tr.mnb-lab-rank[data-rank='2']")
            row2.locator("button.mnb-lab-restart").click()
            expect(panel.locator(".mnb-lab-notice")).to_contain_text("restarting rank 2",
                                                                     timeout=30_000)
            expect(row2.locator("td").nth(2)).to_have_text("1", timeout=60_000)
            expect(row2).to_have_attribute("data-state", re.compile("ready|busy"), timeout=60_000)
            expect(status).to_have_text("mesh 4/4 ranks · cpu", timeout=60_000)
            news = page.locator(".jp-toast-button", has_text="No")  # "notified about news?"
            if news.count():
                news.first.click()
                expect(news).to_have_count(0)
            panel.evaluate("el => { el.scrollLeft = 0; el.scrollTop = 0; }")
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT))

            run_cell(2)
            expect(status).to_have_text("mesh: none", timeout=60_000)
            expect(panel.locator("tr.mnb-lab-rank")).to_have_count(0)
            wait_for(lambda: not worker_pids() - before, timeout=30, what="the ranks to exit")
        except Exception:
            page.screenshot(path=str(ROOT / "browser-failure.png"))
            outputs = page.locator(".jp-OutputArea").all_inner_texts()
            seen = page.evaluate("() => window.__mnbSeen")
            print("outputs:", outputs, "\nstatus texts seen:", seen,
                  "\nconsole:\n" + "\n".join(console[-40:]))
            raise
        finally:
            browser.close()
