"""Controller logic (no sockets): admission, scoring, groups, batches, the trajectory log."""
