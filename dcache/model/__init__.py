"""The model side: where a diffusers transformer keeps its blocks (adapters, per family), what is supported."""
