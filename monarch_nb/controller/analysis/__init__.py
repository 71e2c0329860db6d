"""Pure analysis of what ranks recorded: collectives side by side and the
timeline (mesh.trace). Plain records in, reports out; no sockets."""
