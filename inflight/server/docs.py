"""`/docs`: Swagger UI served from the installed `fastapi-swagger` package, so it works offline (no CDN).

FastAPI's default /docs page loads Swagger UI from cdn.jsdelivr.net and a favicon from fastapi.tiangolo.com;
a cluster without internet access would show a blank page. Here the page and its three assets come from
this server, and Swagger UI's online validator badge is turned off.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from inflight.openai_errors import APIError

ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}

docs_router = APIRouter(include_in_schema=False)


@docs_router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "").rstrip("/")
    return get_swagger_ui_html(
        openapi_url=f"{root}/openapi.json",
        title=f"{request.app.title} - API",
        swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
        swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
        swagger_favicon_url=f"{root}/docs/assets/favicon-32x32.png",
        swagger_ui_parameters={"validatorUrl": None},
    )


@docs_router.get("/docs/assets/{name}")
async def swagger_asset(name: str) -> Response:
    if name not in ASSETS:
        raise APIError(404, f"No docs asset {name!r}.")
    content = files("fastapi_swagger").joinpath("resources", name).read_bytes()
    return Response(content, media_type=ASSETS[name], headers={"Cache-Control": "public, max-age=86400"})
