"""The controller's parts, living in the notebook kernel (or the launching
process): the core (messages in, calls out), a rank's life (life/: the rank
table and its state machine, the pure restart policy, recovery carrying it
out, the event log), calls (calls/: caller, call table, result assembler,
output, data plane), the inspector (stacks, hang watchdog, debugger relay),
the metrics store, and pure analysis of what ranks recorded (analysis/).
Processes are started and watched by monarch_nb.procs, below this package.

Never imported by code that runs inside a rank (engine/).
"""
