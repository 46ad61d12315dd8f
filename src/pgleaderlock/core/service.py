"""The ``async with`` of the library's long-lived objects (the Scheduler's; a
Coordinator's alike), written once."""

from __future__ import annotations

from typing import Self

__all__ = ["Service"]


class Service:
    """A mixin: ``async with`` an object starts it on the way in and shuts it down on the
    way out, whatever ended the block (``start()`` and ``shutdown()`` are the
    subclass's)."""

    async def start(self) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()
