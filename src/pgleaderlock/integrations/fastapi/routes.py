"""The status routes: ``GET path`` answering a status model, and a readiness route."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, TypeVar

from fastapi import APIRouter, Response
from pydantic import BaseModel

__all__ = ["NOT_READY_STATUS_CODE", "status_router"]

NOT_READY_STATUS_CODE = 503
"""HTTP status of the status and readiness routes while the lock is not ready."""

ModelT = TypeVar("ModelT", bound=BaseModel)


def status_router(
    kind: str,
    model: type[ModelT],
    status: Callable[[], ModelT],
    status_code: Callable[[ModelT], int | None],
    path: str,
    ready_path: str | None,
    tags: Sequence[str],
    include_in_schema: bool,
) -> APIRouter:
    """``GET path`` answering ``status()`` with ``status_code(status)`` (``None``:
    200), and ``GET path + ready_path`` answering 503 unless ``status().ready``."""
    router = APIRouter()
    route_tags: list[str | Enum] = list(tags)

    async def status_route(response: Response) -> Any:
        current = status()
        code = status_code(current)
        if code is not None:
            response.status_code = code
        return current

    def route(at: str, name: str, summary: str, answer: Callable[[Response], Any]) -> None:
        router.get(
            at,
            response_model=model,
            tags=route_tags,
            include_in_schema=include_in_schema,
            name=f"{kind}_{name}",
            summary=summary,
        )(answer)

    whose = "leadership" if kind == "leader" else "view of its group"
    route(path, "status", f"This replica's {whose}", status_route)

    if ready_path is not None:

        async def ready_route(response: Response) -> Any:
            current = status()
            if not getattr(current, "ready", False):
                response.status_code = NOT_READY_STATUS_CODE
            return current

        what = "lock takes part in the election" if kind == "leader" else "coordinator runs"
        route(path.rstrip("/") + ready_path, "ready", f"Whether this replica's {what}", ready_route)
    return router
