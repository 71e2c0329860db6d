"""Where the controller listens, and who may connect: the address a
``bind`` option means (loopback by default, an interface, or every one), and
the mesh's CurveZMQ keys (off loopback: the ROUTER is a Curve server, and the
ZAP handler in transport.py admits only the ranks' client key).

Non-goals: the sockets (transport.py), signing (protocol.py).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import zmq

from .. import config
from ..errors import UsageError

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may connect


@dataclass(frozen=True)
class CurveKeys:
    """One mesh's CurveZMQ keys (Z85 text): the controller's server pair and
    the client pair its ranks use. The client public key is what the ZAP
    handler allows; the secrets never leave the controller except in a rank's
    environment or 0600 key file."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def rank_env(self) -> dict[str, str]:
        """What a rank needs to connect (the server secret is not in it)."""
        return {config.ENV_CURVE_SERVER: self.server_public.decode(),
                config.ENV_CURVE_PUBLIC: self.client_public.decode(),
                config.ENV_CURVE_SECRET: self.client_secret.decode()}


def bind_host(bind: str) -> tuple[str, str]:
    """(address to bind, address ranks connect to) for a ``bind`` option."""
    if bind == "localhost":
        return "127.0.0.1", "127.0.0.1"
    if bind == "::1":
        return "[::1]", "[::1]"
    if bind in ("*", "0.0.0.0", "::"):
        # every interface; ranks connect to the address this host's name has
        return "*", host_address()
    try:
        infos = socket.getaddrinfo(bind, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"bind address {bind!r} does not resolve: {exc}") from None
    addr = str(infos[0][4][0])
    host = f"[{addr}]" if ":" in addr else addr
    return host, host


def host_address() -> str:
    """This host's address for other hosts: its name's address, unless that
    is loopback (Debian maps the name to 127.0.1.1), then the address of the
    interface of the default route (a UDP connect sends nothing)."""
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        addr = "127.0.0.1"
    if not addr.startswith("127."):
        return addr
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.255", 9))  # TEST-NET: only the routing table is asked
            return str(s.getsockname()[0])
    except OSError:
        return addr


__all__ = ["ZAP_ENDPOINT", "CurveKeys", "bind_host", "host_address"]
