"""The wire: message schema, framing, HMAC signing and the replay window
(protocol), each kind's meta typed for mypy (metas), serialisation
(serialize), payloads of plain data, one encode/decode pair per layout
(metricframes, payloads; shm and chunks for a RESULT's big frames), and the
ZeroMQ sockets and I/O loop (transport).

Used by both processes; imports nothing from the controller, the rank side or
the front ends. Only transport touches sockets, and nothing here unpickles
before a message is verified.
"""
