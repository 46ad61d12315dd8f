"""``pgleaderlock_singleton`` and ``pgleaderlock_status``."""
