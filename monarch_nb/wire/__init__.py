"""The wire: message schema, framing, HMAC signing and the replay window
(protocol), serialisation (serialize), frame formats of plain data
(metricframes), and the ZeroMQ sockets and I/O loop (transport).

Used by both processes; imports nothing from the controller, the rank side or
the front ends. Only transport touches sockets, and nothing here unpickles
before a message is verified.
"""
