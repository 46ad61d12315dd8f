"""``Started``: a base for test plumbing used as ``with Thing() as thing:``."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self, TypeVar

__all__ = ["Started"]

T = TypeVar("T")


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
