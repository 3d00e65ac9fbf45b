"""Who may use the frontend, and what a caller from another site can do with a browser's login.

- The API key (``--api-key``): API routes take it as ``Authorization: Bearer KEY`` or
  ``x-api-key: KEY``; HTTP Basic (the key as the password, what a browser asks for) only on
  the console's GET routes, which read and change nothing. A browser sends Basic credentials
  with any request to the site, a cross-site form's POST too: were they good for inference,
  any page its user visits could run it. The console's own chat sends the *console token*
  instead (:meth:`KeyGuard.console_token`, from ``GET /console/token`` behind Basic), which a
  page of another site can neither read nor set. Keys are compared in constant time.
- POST bodies must be ``Content-Type: application/json``: the types a cross-site form may send
  (``text/plain`` among them) are refused before the body is read, and a cross-site script
  cannot send JSON without a CORS preflight, which this server never grants.
- ``/v1/responses`` keeps each key's responses apart (:meth:`KeyGuard.namespace`): another
  key's response id is unknown (404), with or without ``--api-key``.
- ``/v1/kvflow/state`` shows every request's tenant (``user``) and id to any key holder:
  :class:`StateRedactor` replaces them with a keyed hash, stable while the process lives (the
  console still tells requests and tenants apart), unless ``--console-show-tenants``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from typing import Any

from kvflow.openai_api.errors import OpenAIError

# A hashed tenant or request id: this many hex digits of HMAC-SHA256 under a per-process key.
HASH_HEX_DIGITS = 12


def api_key_of(headers: Any, allow_basic: bool = False) -> str:
    """The key a request carries: ``Authorization: Bearer KEY``, ``x-api-key: KEY``, or (with
    ``allow_basic``) ``Authorization: Basic`` with the key as the password; "" for none."""
    given = headers.get("authorization", "")
    if given.lower().startswith("bearer "):
        return given[7:]
    if given.lower().startswith("basic "):
        if not allow_basic:
            return ""
        try:
            return base64.b64decode(given[6:], validate=True).decode("utf-8").partition(":")[2]
        except ValueError:
            return ""
    return headers.get("x-api-key", "")


class KeyGuard:
    """The frontend's API key (None: no authentication), and the console token derived from
    it (module doc)."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key
        # Derived, not random: every frontend with the same key accepts the same token.
        self.console_token = None if not api_key else hmac.new(
            api_key.encode(), b"kvflow console token", hashlib.sha256).hexdigest()

    def check(self, headers: Any, console_get: bool = False) -> None:
        """A 401 unless the request carries the key (or the console token); HTTP Basic counts
        only on ``console_get`` routes."""
        if not self.api_key:
            return
        given = api_key_of(headers, allow_basic=console_get).encode()
        expected = [self.api_key.encode()]
        if not console_get and self.console_token:
            expected.append(self.console_token.encode())
        # NOTE: every candidate is compared, so the time taken says nothing of which matched.
        if not sum(hmac.compare_digest(given, key) for key in expected):
            where = ("Authorization: Bearer KEY, or HTTP Basic with the key as the password"
                     if console_get else "Authorization: Bearer KEY or x-api-key: KEY")
            raise OpenAIError(401, f"a valid API key is required ({where})",
                              code="invalid_api_key")


    def namespace(self, headers: Any) -> str:
        """Whose stored responses (``/v1/responses``) a request may see: a hash of the key it
        carries (the console's token counts as the key it derives from). Without
        ``--api-key`` every key is accepted, and each still sees only its own responses."""
        given = api_key_of(headers)
        if self.console_token and hmac.compare_digest(given.encode(),
                                                      self.console_token.encode()):
            given = self.api_key or ""
        return hashlib.sha256(b"kvflow responses " + given.encode("utf-8", "surrogatepass")
                              ).hexdigest()[:32]


def require_json(headers: Any) -> None:
    """A 415 naming Content-Type unless a POST body is declared ``application/json``."""
    given = headers.get("content-type", "")
    if given.partition(";")[0].strip().lower() != "application/json":
        got = f"got {given[:60]!r}" if given else "it is missing"
        raise OpenAIError(415, f"Content-Type must be application/json; {got}",
                          "Content-Type", type_="invalid_request_error",
                          code="unsupported_media_type")


class StateRedactor:
    """``/v1/kvflow/state``'s snapshots with tenants and request ids hashed (module doc), or as
    they are with ``show``."""

    def __init__(self, show: bool) -> None:
        self.show = show
        self._key = secrets.token_bytes(32)

    def hashed(self, value: str) -> str:
        """``value``'s keyed hash: the same for the same value while this process lives."""
        return hmac.new(self._key, value.encode("utf-8", "surrogatepass"),
                        hashlib.sha256).hexdigest()[:HASH_HEX_DIGITS]

    def server_json(self, url: str, snapshot: bytes) -> bytes:
        """One server's entry of the state body: its URL, then its snapshot (the backend's
        JSON object), redacted unless ``show``."""
        head = json.dumps({"url": url})[:-1].encode()
        if self.show:  # passed on as it is: no parse, no re-encoding
            return head + b", " + snapshot[1:]
        state = json.loads(snapshot)
        for request in state.get("requests", ()):
            request["id"] = "r-" + self.hashed(str(request["id"]))
            if request.get("tenant") is not None:
                request["tenant"] = "t-" + self.hashed(str(request["tenant"]))
        return head + b", " + json.dumps(state, separators=(",", ":")).encode()[1:]
