"""``Started``: a base for test plumbing used as ``with Thing() as thing:``."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self

__all__ = ["Started"]


class Started(abc.ABC):
    """Started on entering a ``with`` block (``start()``), closed on leaving it
    (``close()``)."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

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
