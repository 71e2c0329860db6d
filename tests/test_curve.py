"""CurveZMQ on non-loopback binds, with real ranks and real sockets.

The mesh binds to 127.0.0.2: an address that is not one of the loopback
names (so Curve is on, as for any non-loopback bind) and that every Linux
machine has. The cross-namespace version (other hosts' addresses, a capture
on the wire) is tests/test_netns.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import psutil
import pytest
import zmq

from monarch_nb import Mesh
from monarch_nb.config import ENV_CURVE_SECRET, ENV_KEY
from monarch_nb.wire.protocol import Codec, Kind

from .conftest import wait_for

BIND = "127.0.0.2"


@pytest.fixture(scope="module")
def curve_mesh() -> Iterator[Mesh]:
    mesh = Mesh.start(n=2, backend="cpu", bind=BIND)
    yield mesh
    mesh.stop()


def test_non_loopback_mesh_is_encrypted_and_works(curve_mesh: Mesh) -> None:
    ctl = curve_mesh._ctl
    assert ctl.io.curve is not None and ctl.io.router.curve_server
    assert ctl.io.endpoint.startswith(f"tcp://{BIND}:")
    assert curve_mesh.run(lambda x: x * 2, 21) == {0: 42, 1: 42}
    assert curve_mesh.dropped == {}


def test_secrets_are_in_the_environment_never_on_the_command_line(curve_mesh: Mesh) -> None:
    ctl = curve_mesh._ctl
    assert ctl.curve is not None
    secret = ctl.curve.client_secret.decode()
    for proc in ctl.supervisor.procs.values():
        p = psutil.Process(proc.pid)
        assert not any(secret in arg or ctl.key.hex() in arg for arg in p.cmdline())
        env = p.environ()
        assert env[ENV_CURVE_SECRET] == secret and env[ENV_KEY] == ctl.key.hex()
        # the controller's own secret never leaves it
        assert ctl.curve.server_secret.decode() not in "".join(env.values())


def _attacker(ctx: zmq.Context, endpoint: str, curve: tuple[bytes, bytes, bytes] | None,
              key: bytes, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    sock.connect(endpoint)
    return sock


def test_peer_without_the_keys_is_refused_and_executes_nothing(curve_mesh: Mesh,
                                                               tmp_path: object) -> None:
    ctl = curve_mesh._ctl
    assert ctl.curve is not None
    ctx = zmq.Context()
    try:
        # Even holding the HMAC key, with the rank's identity: a plain client
        # fails the Curve handshake, one with its own Curve keys fails ZAP.
        own_pub, own_sec = zmq.curve_keypair()
        ident = ctl.ranks[0].main_id
        marker = os.path.join(str(tmp_path), "pwned")
        frames = Codec(ctl.key, ident.decode()).sign(
            Kind.RESULT, [], call=999,
            meta={"ok": False, "error": {"type": "x", "msg": f"open({marker!r}, 'w')"}})
        before = ctl.io.dropped["curve-refused"]
        plain = _attacker(ctx, ctl.io.endpoint, None, ctl.key, ident)
        keyed = _attacker(ctx, ctl.io.endpoint, (ctl.curve.server_public, own_pub, own_sec),
                          ctl.key, ident)
        for sock in (plain, keyed):
            sock.send_multipart(frames)
        wait_for(lambda: ctl.io.dropped["curve-refused"] > before, timeout=5,
                 what="the ZAP handler to refuse the stranger's key")
        # nothing of theirs ever reached the signature check
        time.sleep(0.3)
        assert set(ctl.io.dropped) == {"curve-refused"}
        assert not os.path.exists(marker)
        for sock in (plain, keyed):
            assert sock.poll(100) == 0  # no answer either
            sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)
    assert curve_mesh.run(lambda: "still fine") == {0: "still fine", 1: "still fine"}


def test_insecure_no_encryption_is_explicit_and_loud(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="monarch_nb.controller.core"), \
            Mesh.start(n=1, backend="cpu", bind=BIND, insecure_no_encryption=True) as mesh:
        assert mesh._ctl.io.curve is None and not mesh._ctl.io.router.curve_server
        assert mesh.run(lambda: 1) == {0: 1}
    assert any("INSECURE" in r.getMessage() for r in caplog.records)
