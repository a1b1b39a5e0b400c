"""Files dcache writes and reads back: atomic writes, checks of values read back, resume-state files."""
