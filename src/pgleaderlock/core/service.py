"""The ``async with`` of the library's long-lived objects (the Scheduler, a Coordinator),
written once."""

from __future__ import annotations

import abc
from typing import Self

__all__ = ["Service"]


class Service(abc.ABC):
    """A base: ``async with`` an object starts it on the way in and shuts it down on the
    way out, whatever ended the block. Subclasses define `start` and `shutdown`."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the object's work."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the object's work and release what it holds; idempotent."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()
