"""A rank's life as the controller sees it: one state machine (the rank
table owns it), the pure restart policy that decides, recovery that
carries the decisions out, and the event log."""
