"""The OpenAI frontend's exposure to other sites and other key holders (issue 43), against the
real frontend and tritonserver: POST bodies must be declared JSON (what a cross-site form can
send is refused unread), and the console's responses carry a content security policy, refuse to
be framed, and are never sniffed. (The API key's routes: tests/test_secrets.py; the state's
hashed tenants: tests/test_console_state.py.)"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.slow  # the OpenAI frontend before tritonserver


def raw_post(frontend, path: str, data: bytes, content_type: str | None) -> tuple[int, dict]:
    headers = {} if content_type is None else {"Content-Type": content_type}
    req = urllib.request.Request(frontend.url + path, data=data, headers=headers)
    if content_type is None:  # urllib would add application/x-www-form-urlencoded
        req.remove_header("Content-type")
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_post_that_is_not_declared_json_is_a_415_naming_content_type(openai_frontend,
                                                                       content_type, path):
    """What a cross-site form may send without a CORS preflight is refused, unread."""
    body = {"prompt": "Hi", "max_tokens": 1} if path != "/v1/chat/completions" else {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    status, answer = raw_post(openai_frontend, path, json.dumps(body).encode(), content_type)
    assert status == 415, answer
    assert answer["error"]["param"] == "Content-Type"
    assert "Content-Type must be application/json" in answer["error"]["message"]


def test_json_with_a_charset_is_json(openai_frontend):
    status, answer = raw_post(openai_frontend, "/v1/completions",
                              json.dumps({"prompt": "Hi", "max_tokens": 1}).encode(),
                              "Application/JSON; charset=utf-8")
    assert status == 200, answer


def test_the_console_sends_its_security_headers(openai_frontend):
    for path in ("/", "/console/console.js", "/console/console.css"):
        with urllib.request.urlopen(openai_frontend.url + path, timeout=60) as r:
            headers, page = r.headers, r.read().decode()
        csp = headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, csp
        assert "unsafe-inline" not in csp
        assert headers["X-Frame-Options"] == "DENY"
        assert headers["X-Content-Type-Options"] == "nosniff"
        if path == "/":  # what the policy allows is all the page needs: no inline script
            assert "<script>" not in page and "style=" not in page
            assert '<script src="/console/console.js">' in page
