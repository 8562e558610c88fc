"""Launch-time preparation (model folders, warm start); imported by the launcher only."""
