"""The engine and what it runs on every transformer call: hooks, executors, signals, decisions, cache state."""
