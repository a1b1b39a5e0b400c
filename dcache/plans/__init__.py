"""Plans: the per-step x per-unit action table of a generation as a versioned file, and what plans carry."""
