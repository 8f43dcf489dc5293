"""The playground: a static page at `/` (and its files under `/static/`) that chats with this server's
`/v1` API in the browser and colours every token by its origin (see `origins.py`).

The page is plain HTML, CSS and JavaScript in `server/api/static/` (no build step, nothing vendored).
It is public like `/health`; the API calls it makes carry the key the user types into it.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"

router = APIRouter(include_in_schema=False)


@router.get("/")
async def playground() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


@router.get("/static")
async def static_root() -> RedirectResponse:
    """`/static` -> `/static/`, a path on this server: never a URL built from the Host header, which the
    client picks (Starlette's own slash redirect did that: an open redirect)."""
    return RedirectResponse("/static/")


def install_playground(app: FastAPI) -> None:
    """Serve the page at `/` and its files at `/static/`."""
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
