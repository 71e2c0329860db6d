"""JupyterLab's visual debugger on a rank, in a real browser: JupyterLab
started on localhost, Debian's chromium driven headless by Playwright, a
notebook that starts 2 ranks and debugs rank 1 (``%monarch debugger --ranks 1``).

The test does what a user does: turns the debugger on (the bug icon in the
notebook's toolbar), clicks the gutter of a ``%%monarch`` cell's line, runs
the cell, reads rank 1's call stack and variables from the debugger's
sidebar, presses *continue*, and stops the mesh. It reads the page's DOM, and
the Jupyter debugger protocol messages the page itself sends and receives on
its kernel's websocket (the ones tests/test_labdebug_kernel.py sends through
jupyter_client). Saves docs/_static/lab-debugger.png (with MNB_SCREENSHOTS=1).

Skipped only where chromium (or Playwright) is missing *and* this is not CI;
in CI (``CI=true``) it runs, and fails if it cannot.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .conftest import wait_for, worker_pids
from .lab_util import CHROMIUM, CHROMIUM_ARGS, ROOT, jupyter_lab, need_browser, screenshot_path

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

SCREENSHOT = screenshot_path("lab-debugger.png")
CELL = ("%%monarch\n"                        # 1
        "x = rank * 10\n"                    # 2
        "y = [x, x + 1]\n"                   # 3
        "z = x + 1\n"                        # 4: the breakpoint
        "print('rank', rank, 'z', z)")       # 5
CELLS = ["%load_ext monarch_nb\n%monarch start -n 2 --backend cpu --no-dashboard",
         "%monarch debugger --ranks 1",
         CELL,
         "%monarch stop"]
# no "get notified about Jupyter news?" prompt over the screenshot
SETTINGS = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}
KERNEL_IDLE = ("() => { const k = window.jupyterapp?.shell?.currentWidget?.sessionContext"
               "?.session?.kernel; return k && k.connectionStatus === 'connected' "
               "&& k.status === 'idle'; }")
# The debugger sidebar's Variables (tree view): name -> the value shown
VARIABLES = """() => Object.fromEntries(
  [...document.querySelectorAll('.jp-DebuggerVariables-body .jp-TreeItem')].map((item) => [
    item.querySelector(':scope > .jp-DebuggerVariables-name')?.textContent,
    item.querySelector(':scope > .jp-DebuggerVariables-detail')?.textContent]))"""
# What a thread is called, asked on the page's own kernel connection
THREADS = """async () => {
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  const reply = await kernel.requestDebug(
      {type: 'request', seq: 0, command: 'threads', arguments: {}}).done;
  return reply.content.body.threads;
}"""


class DebugTraffic:
    """The debug messages on the page's kernel websocket (Jupyter's v1
    websocket protocol, decoded by the server's own function): the DAP
    requests the page sent, the replies and events it received."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []

    def watch(self, page: Any) -> None:
        page.on("websocket", lambda ws: (ws.on("framesent", lambda f: self._note(f, self.sent)),
                                         ws.on("framereceived", lambda f: self._note(f, self.received))))

    @staticmethod
    def _note(frame: str | bytes, into: list[dict[str, Any]]) -> None:
        from jupyter_server.services.kernels.connection.base import deserialize_msg_from_ws_v1

        if isinstance(frame, str):  # the server's event stream, not a kernel's message
            return
        _, parts = deserialize_msg_from_ws_v1(frame)
        header, content = json.loads(parts[0]), json.loads(parts[3])
        if header["msg_type"] in ("debug_request", "debug_reply", "debug_event"):
            into.append(content)

    def wait(self, page: Any, predicate: Callable[[], object], timeout: float, what: str) -> None:
        """Until ``predicate`` holds. Playwright hands the page's frames over
        only while one of its calls runs: the wait runs one (not time.sleep)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout} s waiting for {what}")
            page.wait_for_timeout(50)

    def requests(self, command: str) -> list[dict[str, Any]]:
        return [m for m in self.sent if m.get("command") == command]

    def events(self, event: str) -> list[dict[str, Any]]:
        return [m for m in self.received if m.get("type") == "event" and m.get("event") == event]

    def reply(self, request: dict[str, Any]) -> dict[str, Any] | None:
        return next((m for m in self.received if m.get("type") == "response"
                     and m.get("request_seq") == request["seq"]
                     and m.get("command") == request["command"]), None)


@pytest.fixture
def lab(tmp_path: pathlib.Path) -> Iterator[tuple[str, str]]:
    need_browser()
    with jupyter_lab(tmp_path, "debugger.ipynb", CELLS, settings=SETTINGS) as server:
        yield server


def test_gutter_breakpoint_in_a_monarch_cell_stops_rank_1_in_the_panel(lab: tuple[str, str]) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, token = lab
    ranks_before = worker_pids()
    traffic = DebugTraffic()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        console: list[str] = []
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        traffic.watch(page)

        def run_cell(i: int) -> None:
            # (not awaited: the command's promise resolves when the cell finished)
            page.evaluate("(i) => { const nb = window.jupyterapp.shell.currentWidget.content;"
                          " nb.activeCellIndex = i;"
                          " window.jupyterapp.commands.execute('notebook:run-cell'); }", i)

        try:
            page.goto(f"{url}/lab/tree/debugger.ipynb?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_function(KERNEL_IDLE, timeout=120_000)
            # the file browser folded away: the notebook and the debugger share the page
            page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
            cells = page.locator(".jp-Notebook .jp-Cell")
            run_cell(0)
            cells.nth(0).get_by_text("monarch_nb: 2 ranks ready").wait_for(timeout=180_000)
            run_cell(1)
            cells.nth(1).get_by_text("debugs %%monarch cells on rank 1").wait_for(timeout=60_000)

            # the debugger on, after %load_ext monarch_nb (see docs/debugging.md)
            page.locator(".jp-DebuggerBugButton").click()
            page.locator(".jp-DebuggerBugButton[aria-pressed='true']").wait_for(timeout=60_000)
            page.locator("#jp-debugger-sidebar").wait_for(timeout=30_000)
            # room for the variables on the screenshot: the kernel's module list
            # folded, the Variables section drawn taller
            sources = page.locator("#jp-debugger-sidebar h3[aria-label='Kernel Sources Section']")
            sources.locator(".lm-AccordionPanel-titleLabel").click()
            page.wait_for_function("(h) => h.getAttribute('aria-expanded') === 'false'",
                                   arg=sources.element_handle(), timeout=10_000)
            handle = page.locator("#jp-debugger-sidebar .lm-SplitPanel-handle").first.bounding_box()
            assert handle is not None
            page.mouse.move(handle["x"] + 100, handle["y"] + 2)
            page.mouse.down()
            page.mouse.move(handle["x"] + 100, handle["y"] + 160, steps=8)
            page.mouse.up()

            # a breakpoint clicked in the gutter of the %%monarch cell's line 4
            cell = cells.nth(2)
            numbers = cell.locator(".cm-lineNumbers .cm-gutterElement")
            numbers.filter(has_text="5").wait_for(timeout=30_000)
            line4 = next(i for i in range(numbers.count())
                         if numbers.nth(i).inner_text().strip() == "4")
            cell.locator(".cm-breakpoint-gutter .cm-gutterElement").nth(line4).click()
            page.locator(".jp-DebuggerBreakpoint").wait_for(timeout=30_000)
            assert page.locator(".jp-DebuggerBreakpoint-line").all_inner_texts() == ["4"]
            traffic.wait(page, lambda: [r for r in traffic.requests("setBreakpoints")
                                        if (traffic.reply(r) or {}).get("success")],
                         timeout=30, what="the breakpoint set in the kernel")
            bp = traffic.requests("setBreakpoints")[-1]["arguments"]
            assert [b["line"] for b in bp["breakpoints"]] == [4], bp
            path = bp["source"]["path"]
            dumped = [r for r in traffic.requests("dumpCell") if r["arguments"]["code"] == CELL]
            assert dumped and traffic.reply(dumped[-1])["body"]["sourcePath"] == path

            # the cell runs: rank 1 stops on line 4, rank 0 runs on
            run_cell(2)
            frame = page.locator(".jp-DebuggerCallstackFrame")
            frame.first.wait_for(timeout=120_000)
            wait_for(lambda: "x" in page.evaluate(VARIABLES), timeout=60,
                     what="rank 1's variables in the panel")

            # the call stack: the cell's frame, at the cell's line
            assert frame.count() == 1
            assert frame.locator(".jp-DebuggerCallstackFrame-name").inner_text() == "<module>"
            where = frame.locator(".jp-DebuggerCallstackFrame-location")
            assert where.inner_text() == "Cell [*]:4"
            assert where.get_attribute("title") == path
            assert cell.locator(".jp-DebuggerEditor-highlight").inner_text() == "z = x + 1"
            # ... of the thread named "rank 1": the one stopped, whose stack the panel asked for
            stopped = traffic.events("stopped")
            assert len(stopped) == 1, stopped
            thread = stopped[0]["body"]["threadId"]
            assert stopped[0]["body"]["reason"] == "breakpoint"
            assert [r["arguments"]["threadId"] for r in traffic.requests("stackTrace")] == [thread]
            names = {t["id"]: t["name"] for t in page.evaluate(THREADS)}
            assert names[thread] == "rank 1", names

            # the variables: rank 1's, before line 4 ran
            shown = page.evaluate(VARIABLES)
            assert (shown["rank"], shown["x"], shown["y"]) == ("1", "10", "list"), shown
            assert "z" not in shown, shown
            # (the ranks run this checkout: the module's path in the reply the panel got)
            mnb = [v for r in traffic.requests("variables")
                   for v in (traffic.reply(r) or {}).get("body", {}).get("variables", [])
                   if v["name"] == "mnb"]
            assert mnb and f"from '{ROOT}/monarch_nb/__init__.py'" in mnb[0]["value"], mnb
            # a container expands: y's items come from the rank
            y = page.locator(".jp-DebuggerVariables-body .jp-TreeItem").filter(
                has=page.locator(":scope > .jp-DebuggerVariables-name", has_text="y"))
            y.click()
            page.locator(".jp-DebuggerVariables-body .jp-TreeItem[aria-expanded='true']").wait_for(
                timeout=30_000)
            wait_for(lambda: page.evaluate(VARIABLES).get("1") == "11", timeout=30,
                     what="y expanded in the panel")
            assert page.evaluate(VARIABLES)["0"] == "10"
            page.locator(".jp-DebuggerVariables-body .jp-TreeItem").last.scroll_into_view_if_needed()
            assert "[0] rank 0 z 1" in cell.locator(".jp-OutputArea").inner_text()
            assert "rank 1 z" not in cell.locator(".jp-OutputArea").inner_text()

            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT))
            assert 20_000 < SCREENSHOT.stat().st_size < 300_000

            # continue: the cell completes with both ranks' output
            page.locator("jp-button[data-command='debugger:continue']").click()
            out = cell.locator(".jp-OutputArea")
            out.get_by_text("[1] rank 1 z 11").wait_for(timeout=60_000)
            assert "[0] rank 0 z 1" in out.inner_text()
            traffic.wait(page, lambda: [e for e in traffic.events("continued")
                                        if e["body"]["threadId"] == thread],
                         timeout=30, what="the continued event")
            # answered: the kernel's control channel is not held by it (see labdebug.py)
            (pressed,) = traffic.requests("continue")
            traffic.wait(page, lambda: traffic.reply(pressed), timeout=30, what="continue answered")
            assert traffic.reply(pressed)["success"], traffic.reply(pressed)
            page.wait_for_function(KERNEL_IDLE, timeout=60_000)
            assert frame.count() == 0
            # the cell's prompt leaves [*] (on its execute_reply, which the page
            # may get after the kernel's idle status: wait for it, don't read it)
            expect(cell.locator(".jp-InputArea-prompt")).not_to_have_text("[*]:", timeout=30_000)

            # the mesh stops; nothing is left running
            run_cell(3)
            cells.nth(3).get_by_text("monarch_nb: stopped 2 ranks").wait_for(timeout=60_000)
            wait_for(lambda: worker_pids() <= ranks_before, timeout=30,
                     what="the ranks gone after %monarch stop")
            failed = [(r["command"], traffic.reply(r)) for r in traffic.sent
                      if not (traffic.reply(r) or {"success": True}).get("success")]
            assert not failed, failed
        except (Exception, pytest.fail.Exception) as exc:
            page.screenshot(path=str(ROOT / "browser-failure.png"))
            asked = [(r["command"], r.get("arguments"), "answered" if traffic.reply(r) else "unanswered")
                     for r in traffic.sent if r["command"] != "inspectVariables"]
            told = [(e["event"], e.get("body")) for e in traffic.received if e.get("type") == "event"]
            raise AssertionError(
                f"{exc}\noutputs: {page.locator('.jp-OutputArea').all_inner_texts()}\n"
                f"variables shown: {page.evaluate(VARIABLES)}\n"
                f"debug requests: {asked[-30:]}\nevents: {told[-20:]}\n"
                "console:\n" + "\n".join(console[-40:])) from exc
        finally:
            browser.close()
