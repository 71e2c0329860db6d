"""The controller's parts, living in the notebook kernel (or the launching
process): the controller core (messages in, calls out), the call table, the
rank table with its state machine, recovery carrying out the restart policy,
the supervisor and its spawner thread, launchers, the inspector (stacks,
hang watchdog, debugger relay), the metrics store and output routing.

Never imported by code that runs inside a rank (engine/).
"""
