"""The tests' own app: management commands to run as singletons, and probes."""
