"""Everything that runs inside a rank process: the worker loop, output
capture, health probes, the debugger relay, the ``mnb.log`` buffer, the
script runner, spares, the rank's identity (``mnb.rank()``) and the remote
join entry.

Never imports the controller (controller/) or the front ends (ui/).
"""
