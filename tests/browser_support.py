"""Debian's headless Chromium and chromium-driver (``make browser`` installs both): where they
are, and the mark that skips a browser test without them (the ``browser`` fixture: conftest)."""

from __future__ import annotations

import shutil

import pytest

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="Debian's chromium and chromium-driver are not installed (make browser)")
