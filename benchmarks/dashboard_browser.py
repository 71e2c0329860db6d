#!/usr/bin/env python3
"""The dashboard's browser side under load: headless chromium (Debian's, via
Playwright), the real ``monarch_nb/ui/static/dashboard.js`` with a stand-in
model, fed 60 s of training (100 steps/s with 2 metrics per rank, as 10
deltas a second). Prints the time from a delta's arrival to the end of the
next animation frame, which includes the wait for that frame (up to 16.7 ms
at 60 Hz).

    .venv/bin/python benchmarks/dashboard_browser.py [RANKS ...]   # default: 4 64
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

from playwright.sync_api import sync_playwright

REPO = pathlib.Path(__file__).resolve().parent.parent
JS = (REPO / "monarch_nb" / "ui" / "static" / "dashboard.js").read_text()
PAGE = """<html><body><div id=root style="width:1000px"></div><script type=module>
const src = document.getElementById('src').textContent;
const mod = await import(URL.createObjectURL(new Blob([src], {type: 'text/javascript'})));
const handlers = [];
const model = { get: () => 'bench', on: (ev, fn) => handlers.push(fn), send: () => {} };
mod.default.initialize({model});
mod.default.render({model, el: document.getElementById('root')});
window.feed = (msg) => { for (const h of handlers) h(msg); };
window.ready = true;
</script><script id=src type=text/plain>""" + JS.replace("</script>", "<\\/script>") + "</script></body></html>"


def run(page, world: int) -> list[float]:
    page.reload()
    page.wait_for_function("window.ready === true")
    tiles = [{"rank": r, "state": "busy", "pid": r, "incarnation": 0, "device": "cpu", "cpu": 50,
              "rss": 2e8, "sps": 100, "last": {"loss": "0.5"}} for r in range(world)]
    page.evaluate("m => window.feed(m)", {"t": "snapshot", "world": world, "series": [],
                                         "tiles": tiles, "events": [], "names": ["loss", "lr"]})
    times, step = [], 0
    for _ in range(600):
        series = []
        for r in range(world):
            steps = list(range(step, step + 10))
            series.append([r, "loss", steps, [1.0 / (1 + s) + r * 0.01 for s in steps]])
            series.append([r, "lr", steps, [0.001] * 10])
        step += 10
        times.append(page.evaluate(
            """m => new Promise(res => { const t0 = performance.now(); window.feed(m);
               requestAnimationFrame(() => res(performance.now() - t0)); })""",
            {"t": "delta", "series": series, "tiles": tiles[:8]}))
    return times


def main() -> None:
    worlds = [int(a) for a in sys.argv[1:]] or [4, 64]
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        path = pathlib.Path(tmp) / "page.html"
        path.write_text(PAGE)
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                     args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(path.as_uri())
            print("| ranks | delta to drawn, median (ms) | p90 | median of the last 10 s |")
            print("|---:|---:|---:|---:|")
            for world in worlds:
                t = run(page, world)
                s = sorted(t)
                last = sorted(t[-100:])
                print(f"| {world} | {s[len(s) // 2]:.1f} | {s[int(len(s) * 0.9)]:.1f} | "
                      f"{last[len(last) // 2]:.1f} |")
        finally:
            browser.close()


if __name__ == "__main__":
    main()
