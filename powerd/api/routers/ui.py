"""The live page: `/ui`, one self-contained page (HTML, CSS and JavaScript shipped in
powerd/api/ui/; nothing is fetched from anywhere else). The files are public: they hold no
data. The page asks for a token and reads the JSON API with it, like any other client, so
it can show nothing a viewer token could not read (docs/operations.md, "The live page").

The sign-in link for wall displays carries the token in the URL fragment (`/ui#token=…`),
which browsers never send to a server: it reaches no access log and no proxy.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Literal

from fastapi import APIRouter, Response

router = APIRouter(tags=["ui"], include_in_schema=False)

TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
# Only the page's own files run or style it, it talks only to this server, and no other
# site may frame it (clickjacking) or learn where it was (referrer).
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@cache
def asset(name: str) -> bytes:
    """One of the page's files, read once from the installed package."""
    return (resources.files("powerd.api") / "ui" / name).read_bytes()


def _file(name: str) -> Response:
    return Response(asset(name), media_type=TYPES[name], headers=HEADERS)


# Plain functions: the first read of a file happens in the thread pool, not on the loop.
@router.get("/ui")
def page() -> Response:
    return _file("index.html")


@router.get("/ui/{name}")
def page_asset(name: Literal["app.js", "app.css"]) -> Response:
    return _file(name)
