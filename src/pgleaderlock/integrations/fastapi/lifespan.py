"""What the lifespans share: the lifespan protocol and composition with other
lifespans."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TypeVar

__all__ = ["AppLifespan"]

AppT = TypeVar("AppT")
StateT = TypeVar("StateT")


class AppLifespan(abc.ABC):
    """What the lifespans share: the lifespan protocol and composition with other
    lifespans (`wrap`)."""

    @abc.abstractmethod
    def run(self) -> AbstractAsyncContextManager[None]:
        """Start, and on exit stop (the building block of the lifespan)."""

    def __call__(self, app: object) -> AbstractAsyncContextManager[None]:
        """The FastAPI lifespan: ``FastAPI(lifespan=leader)``."""
        return self.run()

    def wrap(
        self, lifespan: Callable[[AppT], AbstractAsyncContextManager[StateT]]
    ) -> Callable[[AppT], AbstractAsyncContextManager[StateT]]:
        """Compose with the app's own lifespan: ``FastAPI(lifespan=leader.wrap(lifespan))``.

        Order: your lifespan's startup runs first, then the lock (or coordinator)
        starts; at shutdown the lock is shut down (leader tasks stopped) first, then
        your lifespan's shutdown runs. So whatever your lifespan sets up (pools,
        clients) exists before any leader task starts and until every leader task has
        ended. Whatever your lifespan yields (a state dict, or nothing) is passed on
        unchanged. Usable as a decorator on top of ``@asynccontextmanager``.

        ``lifespan`` may be another ``LeaderLifespan`` or ``GroupLifespan``:
        ``a.wrap(b)`` runs both in one app (``b`` starts first and is shut down last);
        add ``a.wrap(b.wrap(your_lifespan))`` for your own lifespan as well.
        """

        @asynccontextmanager
        async def composed(app: AppT) -> AsyncIterator[StateT]:
            async with lifespan(app) as state, self.run():
                yield state

        return composed
