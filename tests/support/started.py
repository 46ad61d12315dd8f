"""``Started``: a base for test plumbing used as ``with Thing() as thing:``; and
``all_closed``, for test plumbing closed with ``await thing.close()``."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Awaitable
from types import TracebackType
from typing import Protocol, Self, TypeVar

__all__ = ["Started", "all_closed"]

T = TypeVar("T")


class AsyncClosable(Protocol):
    def close(self) -> Awaitable[object]: ...


@contextlib.asynccontextmanager
async def all_closed() -> AsyncIterator[list[AsyncClosable]]:
    """A list for the block to put things in; on leaving, each is closed, in order."""
    made: list[AsyncClosable] = []
    try:
        yield made
    finally:
        for thing in made:
            await thing.close()


class Started(abc.ABC):
    """Started on entering a ``with`` block (``start()``), closed on leaving it
    (``close()``)."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def _started(self, part: T | None) -> T:
        """``part``, which only a started one has (else ``RuntimeError``)."""
        if part is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        return part

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
