"""Asking an ASGI app (a replica's FastAPI app, driven in-process) over HTTP."""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["leader_view"]


async def leader_view(app: Any, path: str = "/leader") -> dict[str, Any]:
    """``GET path`` on ``app`` (the integrations' leader-status route by default); asserts
    a 200 and returns the JSON body."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as http:
        response = await http.get(path)
        assert response.status_code == 200
        return response.json()  # type: ignore[no-any-return]
