"""The chat page at `/`: static HTML, CSS and JavaScript from web/static/, no build step, nothing fetched
from elsewhere. The page talks to the same /v1/chat/completions stream any client uses."""

from __future__ import annotations

from pathlib import Path

from quart import Blueprint, Response, send_from_directory

STATIC_DIR = Path(__file__).resolve().parent / "static"

# The page loads only its own files and talks only to its own origin; model output is rendered as text.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",  # frame-ancestors' fallback for older browsers
}

blueprint = Blueprint("chat_page", __name__, static_folder=str(STATIC_DIR), static_url_path="/static")


@blueprint.get("/")
async def index() -> Response:
    return await send_from_directory(STATIC_DIR, "index.html")


@blueprint.after_request
async def revalidate(response: Response) -> Response:
    # On every file: /static/index.html is the page too, and must not be framed by another site either.
    response.headers.update(PAGE_HEADERS)
    response.headers["Cache-Control"] = "no-cache"  # revalidated (ETag) on each load: an upgrade is never stale
    return response
