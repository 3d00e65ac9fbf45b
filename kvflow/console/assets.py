"""The console's files (``static/``), and the headers every console response carries: the page
runs only its own script and style, is never framed by another site, and no response is
sniffed into another type. Shared by the OpenAI frontend and ``kvflow simulate --console``."""

from __future__ import annotations

from importlib.resources import files

# The page's assets, by name, and their media types (index.html is the page itself).
CONSOLE_ASSETS = {"console.js": "text/javascript", "console.css": "text/css"}
# NOTE: the page has no inline script or style (console.js sets element.style properties,
# which a CSP allows; a style attribute in markup it would not). connect-src 'self': the page
# talks to this server alone.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; "
                           "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                           "form-action 'none'; frame-ancestors 'none'")
CONSOLE_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY,
                   "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
                   "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}


def console_file(name: str) -> bytes:
    """The bytes of ``static/<name>`` (``index.html`` or one of :data:`CONSOLE_ASSETS`)."""
    return files("kvflow.console").joinpath("static", name).read_bytes()
