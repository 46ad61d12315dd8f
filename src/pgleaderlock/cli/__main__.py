"""``python -m pgleaderlock.cli``: the same as the ``pgleaderlock`` console script."""

from . import main

main()
