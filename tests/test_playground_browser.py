"""The playground page in a real headless browser (Debian's chromium driven by Playwright).

Starts the app on the tiny model that repeats a sentence (n-gram drafts land on it), loads `/`, enters
the API key, chats with `ngram` at temperature 0, checks the coloured token spans against the API's
text for the same request, runs both race modes, and saves a screenshot to `tests/artifacts/`.
Skipped only when chromium or Playwright is missing outside CI; with CI=true a missing browser fails.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.live_server import live_server

pytestmark = pytest.mark.slow  # left out of make test-fast (seconds each)


CHROMIUM = "/usr/bin/chromium"  # Debian's package; Playwright cannot download browsers here
ARTIFACTS = Path(__file__).parent / "artifacts"
KEY = "playground-test-key"
PROMPT = "Fix the typos: Teh quick brwon fox jumsp over teh lazy dgo. Teh quick brwon fox jumsp over teh lazy dgo."
MAX_TOKENS = 40


def _require_browser() -> None:
    missing = []
    if not (shutil.which(CHROMIUM) or os.path.exists(CHROMIUM)):
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("playwright (pip install -e '.[dev]')")
    if missing:
        message = "the browser test needs " + " and ".join(missing)
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)


def _spans(page, turn: str) -> list[dict[str, str]]:
    return page.eval_on_selector_all(
        f"{turn} .tok",
        "els => els.map(e => ({text: e.textContent, origin: e.dataset.origin, proposer: e.dataset.proposer}))",
    )


def test_playground_colours_tokens_and_races(cycling_target):
    _require_browser()
    from playwright.sync_api import expect, sync_playwright

    with live_server(cycling_target, None, api_key=KEY) as (url, _app):
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.goto(url + "/")

                # Without the key the page says so; with it, the controls fill from /v1/models.
                expect(page.locator("#status")).to_contain_text("API key")
                page.fill("#api-key", KEY)
                page.dispatch_event("#api-key", "change")
                expect(page.locator("body")).to_have_attribute("data-ready", "true")
                assert page.input_value("#model") == "tiny-cycling"
                assert page.input_value("#method") == "auto"  # the server's default method, preselected
                assert page.eval_on_selector_all("#method option", "os => os.map(o => o.value)") == [
                    "none", "ngram", "suffix", "auto",
                ]

                page.select_option("#method", "ngram")
                page.fill("#k", "4")
                page.fill("#temperature", "0")
                page.fill("#max-tokens", str(MAX_TOKENS))

                # Shift+Enter is a new line; Enter sends.
                box = page.locator("#prompt")
                box.click()
                box.type("first line")
                box.press("Shift+Enter")
                box.type("second line")
                assert page.input_value("#prompt") == "first line\nsecond line"
                assert page.locator(".turn").count() == 0
                box.fill(PROMPT)
                box.press("Enter")
                expect(page.locator(".turn").nth(0)).to_have_attribute("data-state", "done", timeout=60_000)

                spans = _spans(page, ".turn:nth-child(1)")
                assert len(spans) == MAX_TOKENS
                assert any(s["origin"] == "accepted" and s["proposer"] == "ngram" for s in spans)
                assert {s["origin"] for s in spans} <= {"accepted", "recovered", "bonus", "plain"}
                assert page.locator(".turn:nth-child(1) [data-figure=acceptance] b").inner_text().endswith("%")

                api = httpx.post(
                    f"{url}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {KEY}"},
                    json={
                        "model": "tiny-cycling",
                        "messages": [{"role": "user", "content": PROMPT}],
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "speculation": {"method": "ngram", "num_tokens": 4},
                    },
                    timeout=60,
                ).json()
                assert "".join(s["text"] for s in spans) == api["choices"][0]["message"]["content"]

                # Race mode, both schedules: two panes finish and a speedup figure appears.
                for n, schedule in enumerate(("together", "turns"), start=2):
                    page.select_option("#race", schedule)
                    box.fill(PROMPT)
                    box.press("Enter")
                    turn = page.locator(".turn").nth(n - 1)
                    expect(turn).to_have_attribute("data-state", "done", timeout=60_000)
                    panes = turn.locator(".reply")
                    assert panes.count() == 2
                    assert [panes.nth(i).get_attribute("data-method") for i in range(2)] == ["none", "ngram"]
                    assert [panes.nth(i).get_attribute("data-state") for i in range(2)] == ["done", "done"]
                    assert float(turn.locator("[data-speedup]").get_attribute("data-speedup")) > 0
                    plain = _spans(page, f".turn:nth-child({n}) .reply[data-method=none]")
                    spec = _spans(page, f".turn:nth-child({n}) .reply[data-method=ngram]")
                    assert {s["origin"] for s in plain} == {"plain"}
                    assert "".join(s["text"] for s in plain) == "".join(s["text"] for s in spec)  # greedy: lossless

                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)
                assert errors == []
            finally:
                browser.close()


def test_playground_shows_a_method_the_server_turned_off(tiny_target, monkeypatch):
    """A reply whose method failed safe (the draft proposer raises at every draft) says so under it: which
    proposer, why, and that the reply decoded without it."""
    _require_browser()
    from playwright.sync_api import expect, sync_playwright

    from server.speculation.draft_model import DraftModelProposer

    def broken(self, seqs, ks):  # noqa: ANN001
        raise RuntimeError("Expected attn_mask dtype to match query dtype")

    monkeypatch.setattr(DraftModelProposer, "propose", broken)
    with live_server(tiny_target, tiny_target) as (url, _app):
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.goto(url + "/")
                expect(page.locator("body")).to_have_attribute("data-ready", "true")
                page.select_option("#method", "draft")
                page.fill("#max-tokens", "8")
                page.fill("#prompt", PROMPT)
                page.press("#prompt", "Enter")
                expect(page.locator(".turn").nth(0)).to_have_attribute("data-state", "done", timeout=60_000)
                note = page.locator(".reply [data-role=fallback]")
                expect(note).to_have_count(1)
                assert note.get_attribute("data-proposer") == "draft" and note.get_attribute("data-reason") == "error"
                expect(note).to_contain_text("draft was turned off for this reply")
                expect(note).to_contain_text("RuntimeError")
                plain = page.locator(".reply .tok")
                assert {plain.nth(i).get_attribute("data-origin") for i in range(plain.count())} == {"plain"}
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "playground-fallback.png"), full_page=True)
                assert errors == []
            finally:
                browser.close()
