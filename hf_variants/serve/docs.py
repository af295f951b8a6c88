"""`GET /docs`: the Swagger page of the OpenAPI schema, with its assets served by the server itself (the
`swagger-ui-bundle` package of the serve extra), never from a CDN: the page works on a machine without internet.
Without that package `/docs` answers 404 saying what to install; `--no_docs` turns the page off."""

from __future__ import annotations

from pathlib import Path

ASSETS = {
    "swagger-ui-bundle.js": "application/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' "
    "'unsafe-inline'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def assets_folder() -> Path | None:
    """The folder of Swagger UI's files (`swagger_ui_bundle`), or None when the package is not installed."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    folder = Path(str(swagger_ui_path))
    return folder if all((folder / name).is_file() for name in ASSETS) else None


def docs_page(title: str) -> str:
    """The Swagger page, its script and style from `/docs/assets/` (relative URLs: it works behind a path prefix)."""
    from fastapi.openapi.docs import get_swagger_ui_html

    return get_swagger_ui_html(
        openapi_url="openapi.json",
        title=f"{title} - API",
        swagger_js_url="docs/assets/swagger-ui-bundle.js",
        swagger_css_url="docs/assets/swagger-ui.css",
        swagger_favicon_url="docs/assets/favicon-32x32.png",
    ).body.decode("utf-8")
