"""The backend-neutral core of pgleaderlock: state machine, lifecycle task, retry, keys.

Nothing in this package imports a database driver.
"""
