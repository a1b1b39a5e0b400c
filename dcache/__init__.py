"""dcache: feature caching for diffusion transformers."""
