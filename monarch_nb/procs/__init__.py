"""Starting and watching rank processes: the supervisor and its spawner
thread, spares, launchers (where a process starts), liveness from the
process state, log directories, machine limits, why a process died.

Used by the controller for its own host, and by the host agent for
its host. Never imports the controller, the rank side or front ends.
"""
