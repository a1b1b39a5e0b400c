"""Caching policies: one file per method (frozen config + schedule); importing registers them."""

from . import fbcache, magcache  # noqa: F401
