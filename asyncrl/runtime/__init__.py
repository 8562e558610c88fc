"""Run-time support without torch: launch-time preparation (model folders, warm start), durable files, the
run-folder lock and the choice of a verified checkpoint to resume from."""
