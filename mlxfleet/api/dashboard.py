"""The web dashboard at ``/``: static files shipped in the package (``mlxfleet/ui``).

The page holds no data of its own: it reads the public and control APIs with the API
key the user types (kept in the tab's session storage), so serving it needs no key.
``/`` answers browsers with the page and everyone else with Ollama's liveness text,
which Ollama clients probe for.
"""

from __future__ import annotations

from pathlib import Path

from quart import Quart, Response, request

from ..wire import APIError

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}


def register_dashboard(app: Quart) -> None:
    @app.route("/", methods=["GET", "HEAD"])
    async def root():
        if "text/html" in request.headers.get("Accept", ""):
            return _file("index.html")
        return Response("Ollama is running", content_type="text/plain; charset=utf-8")

    @app.get("/ui/<name>")
    async def asset(name: str):
        return _file(name)


def _file(name: str) -> Response:
    path = (UI_DIR / name).resolve()
    if path.parent != UI_DIR or not path.is_file() or path.suffix not in TYPES:
        raise APIError(404, f"No such file: /ui/{name}", type="not_found_error",
                       code="not_found")
    return Response(path.read_bytes(), content_type=TYPES[path.suffix],
                    headers={"Cache-Control": "no-cache",
                             "Content-Security-Policy": "default-src 'self'; "
                             "img-src 'self' data:; style-src 'self'"})
