"""Coverage-guided fuzzing of the message verifier (``Codec.verify``) with atheris.

Optional: ``pip install atheris`` (not in any extra; tests/test_fuzz.py is the
hypothesis suite that runs in ``make test``). Each input is turned into one
message, in one of three ways: raw frames (no valid signature), a first frame
signed with the right key (to reach the header parser: a buggy key holder),
or a real signed message with one byte changed. The property is the one the
hypothesis tests state: verify returns a well-typed message or raises
ProtocolError, and nothing is ever unpickled (an audit hook on
``pickle.find_class`` aborts the run).

    .venv/bin/python scripts/fuzz_verify.py -atheris_runs=200000
    .venv/bin/python scripts/fuzz_verify.py CORPUS_DIR -max_total_time=600

A crash leaves ``crash-<sha1>`` in the working directory: feed it back as the
only argument to reproduce.
"""

from __future__ import annotations

import hashlib
import hmac
import sys
from typing import Any

import atheris

with atheris.instrument_imports(include=["monarch_nb.wire.protocol"]):
    from monarch_nb.errors import ProtocolError
    from monarch_nb.wire.protocol import Codec, Kind

KEY = bytes(range(32))
_verifying = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "pickle.find_class" and _verifying:
        raise SystemExit(f"unpickled {args} during verification")


sys.addaudithook(_audit)
# One receiving codec for the whole run: replay windows and the sender cache
# fill up as they would on a long-lived controller.
RX = Codec(KEY, "rx")


def _frames(fdp: atheris.FuzzedDataProvider) -> list[bytes]:
    mode = fdp.ConsumeIntInRange(0, 2)
    n = fdp.ConsumeIntInRange(0, 5)
    if mode == 0:  # raw frames
        return [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 400)) for _ in range(n + 1)]
    if mode == 1:  # any header, correctly signed
        rest = [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)) for _ in range(n)]
        body = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 400))
        h = hmac.new(KEY, body, hashlib.sha256)
        for p in rest:
            h.update(p)
        return [h.digest() + body, *rest]
    kinds = list(Kind)  # a real message with one bit flipped
    kind = kinds[fdp.ConsumeIntInRange(0, len(kinds) - 1)]
    payload = [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)) for _ in range(n)]
    frames = [bytes(f) for f in Codec(KEY, "tx", inline_max=fdp.ConsumeIntInRange(-1, 64)).sign(
        kind, payload, call=fdp.ConsumeIntInRange(0, 2**32))]
    i = fdp.ConsumeIntInRange(0, len(frames) - 1)
    if frames[i]:
        b = bytearray(frames[i])
        b[fdp.ConsumeIntInRange(0, len(b) - 1)] ^= 1 << fdp.ConsumeIntInRange(0, 7)
        frames[i] = bytes(b)
    return frames


def test_one_input(data: bytes) -> None:
    global _verifying
    frames = _frames(atheris.FuzzedDataProvider(data))
    _verifying = True
    try:
        msg = RX.verify(frames)
    except ProtocolError:
        return
    finally:
        _verifying = False
    assert isinstance(msg.kind, Kind) and isinstance(msg.meta, dict)
    assert [len(bytes(p)) for p in msg.payload] == list(msg.lengths)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
