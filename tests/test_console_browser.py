"""The live console in a real browser: Debian's headless Chromium, driven by Selenium through
Debian's chromium-driver (``make browser`` installs both), against the real tritonserver and
frontend. Chats sent from the page show up running in the engine view, then finish, and the
KV grid returns to free; the page fetches nothing from outside the server."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.browser_support import needs_browser

pytestmark = pytest.mark.slow  # tritonserver, the frontend and a browser


def wait_until(what: str, condition, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def not_blank(png: Path) -> bool:
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    return pixels.std() > 0.05 and len({tuple(p) for p in pixels[::20, ::20].reshape(
        -1, pixels.shape[-1]).tolist()}) > 8


@needs_browser
def test_chats_from_the_page_run_in_the_engine_view_then_free_the_pool(
        browser, openai_frontend, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(openai_frontend.url + "/")
    wait_until("the model's name", lambda: browser.find_element(By.ID, "model").text
               not in ("", "console"), 60)
    for field, value in (("parallel", "3"), ("max_tokens", "96"), ("temperature", "0.8"),
                         ("seed", "7")):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    browser.find_element(By.ID, "prompt").send_keys("Tell me a story about a robot.")
    browser.find_element(By.ID, "send").click()

    def states() -> list[str]:  # read in one go: the page redraws the rows 4 times a second
        return browser.execute_script(
            "return [...document.querySelectorAll('#requests tbody tr[data-state]')]"
            ".map(r => r.dataset.state)")

    def kv_used() -> int:
        return int(browser.execute_script("return document.getElementById('kv').dataset.used"))

    def in_flight():
        return [s for s in states() if s in ("prefill", "decode")]

    wait_until("the chats running in the engine view", in_flight)
    shot = Path(os.environ.get("KVFLOW_CONSOLE_SCREENSHOT", tmp_path / "console.png"))
    assert browser.save_screenshot(str(shot)) and not_blank(shot)
    assert kv_used() > 0
    replies = wait_until("three finished replies", lambda: (
        cards := browser.find_elements(By.CSS_SELECTOR, ".reply")) and len(cards) == 3
        and all(c.get_attribute("data-done") == "true" for c in cards) and cards)
    for card in replies:
        assert "error" not in card.get_attribute("class"), card.text
        assert card.find_element(By.TAG_NAME, "pre").text.strip()
        assert "TTFT" in card.find_element(By.CLASS_NAME, "stats").text
    wait_until("the engine idle and the KV grid free", lambda: not states() and kv_used() == 0)
    # Every request the page made went to this server.
    urls = [m["params"]["request"]["url"] for m in (
        json.loads(e["message"])["message"] for e in browser.get_log("performance"))
        if m["method"] == "Network.requestWillBeSent"]
    assert urls and all(u.startswith(openai_frontend.url + "/") for u in urls), urls
    assert_no_policy_violation(browser)


def assert_no_policy_violation(browser) -> None:
    """The page's content security policy refused nothing it does."""
    refused = [e["message"] for e in browser.get_log("browser")
               if "Content Security Policy" in e["message"]]
    assert not refused, refused


@needs_browser
def test_with_an_api_key_the_page_chats_with_its_token(browser, keyed_server, tmp_path):
    """The browser's Basic login opens the page; its scripts reach the API with the console's
    token (an API route takes no Basic login), and a chat from the page runs."""
    from selenium.webdriver.common.by import By

    from kvflow.openai_api import FrontendConfig, FrontendProcess
    from kvflow.utils.procs import free_port

    frontend = FrontendProcess(FrontendConfig((keyed_server.grpc_url,), port=free_port(),
                                              api_key="s3cret-key"),
                               log_path=tmp_path / "frontend.log")
    frontend.start()
    try:
        browser.get(frontend.url.replace("http://", "http://anyone:s3cret-key@") + "/")
        wait_until("the model's name", lambda: browser.find_element(By.ID, "model").text
                   not in ("", "console"), 60)
        wait_until("the state polled", lambda: "updated" in browser.find_element(
            By.ID, "status").text, 60)
        element = browser.find_element(By.ID, "max_tokens")
        element.clear()
        element.send_keys("8")
        browser.find_element(By.ID, "prompt").send_keys("Hello")
        browser.find_element(By.ID, "send").click()
        card = wait_until("the reply", lambda: (
            cards := browser.find_elements(By.CSS_SELECTOR, ".reply")) and cards[0]
            .get_attribute("data-done") == "true" and cards[0])
        assert "error" not in card.get_attribute("class"), card.text
        assert "TTFT" in card.find_element(By.CLASS_NAME, "stats").text
        assert_no_policy_violation(browser)
    finally:
        assert frontend.stop() == 0


def test_with_an_api_key_the_page_asks_for_it(keyed_server, tmp_path):
    import base64

    from kvflow.openai_api import FrontendConfig, FrontendProcess
    from kvflow.utils.procs import free_port

    frontend = FrontendProcess(FrontendConfig((keyed_server.grpc_url,), port=free_port(),
                                              api_key="s3cret-key"),
                               log_path=tmp_path / "frontend.log")
    frontend.start()

    def get(path: str, auth: str | None = None) -> tuple[int, Any]:
        headers = {"Authorization": auth} if auth else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(frontend.url + path,
                                                               headers=headers), timeout=60) as r:
                return r.status, r.headers
        except urllib.error.HTTPError as e:
            return e.code, e.headers

    try:
        status, headers = get("/")
        assert status == 401 and headers.get("WWW-Authenticate", "").startswith("Basic")
        assert get("/console/console.js")[0] == 401
        basic = "Basic " + base64.b64encode(b"anyone:s3cret-key").decode()
        assert get("/", basic)[0] == 200 and get("/console/console.js", basic)[0] == 200
        assert get("/", "Basic " + base64.b64encode(b"anyone:wrong").decode())[0] == 401
        # The API routes take no Basic login: the page's scripts send the console's token.
        assert get("/v1/kvflow/state", basic)[0] == 401
        with urllib.request.urlopen(urllib.request.Request(
                frontend.url + "/console/token", headers={"Authorization": basic}),
                timeout=60) as r:
            token = json.loads(r.read())["token"]
        assert get("/v1/kvflow/state", f"Bearer {token}")[0] == 200
    finally:
        assert frontend.stop() == 0
