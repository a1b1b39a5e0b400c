"""The engine and what it runs on every transformer call: hooks, executors, signals, decisions, cache state."""

from . import built_in_signals  # noqa: F401  (registers the built-in signals: the registry is complete on import)
