"""The web dashboard at ``/``, driven in a real headless Chromium (Debian's package,
installed by ``scripts/setup.sh test``) through Playwright.

Screenshots of each page are saved in the test's temporary folder and checked not blank.
"""

from __future__ import annotations

import os

import httpx
import pytest
from conftest import CHROMIUM
from served import Served, manifest

if CHROMIUM is None and not os.environ.get("CI"):
    pytest.skip("no chromium here (scripts/setup.sh test installs it)",
                allow_module_level=True)

KEY = "dash-key-123"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    f = Served(tmp_path_factory.mktemp("dashboard"))
    f.write("demo.yaml", manifest("demo", source="builtin:demo", aliases=["default"],
                                  defaults={"temperature": 0}))
    f.write("tiny.yaml", manifest("tiny", preload=False))
    f.start()
    f.wait_ready("demo")
    yield f
    f.stop()


@pytest.fixture
def page(browser, tmp_path):
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.shots = tmp_path
    yield pg
    ctx.close()
    assert not errors, errors  # no script error on any page


def not_blank(pg, name: str) -> None:
    """Save a screenshot and check it shows something: many distinct colors."""
    from PIL import Image

    path = pg.shots / f"{name}.png"
    pg.screenshot(path=str(path), full_page=True)
    img = Image.open(path).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20)
    assert img.size[0] >= 300 and colors and len(colors) > 20, f"{path} looks blank"


def row(pg, name: str):
    return pg.locator(f"#models-table tr[data-model='{name}']")


def test_root_is_the_dashboard_for_browsers_and_ollamas_probe_otherwise(served):
    assert httpx.get(served.url + "/").text == "Ollama is running"
    r = httpx.get(served.url + "/", headers={"Accept": "text/html"})
    assert r.status_code == 200 and "<title>mlxfleet</title>" in r.text
    assert httpx.get(served.url + "/ui/app.js").headers["content-type"].startswith(
        "text/javascript")
    assert httpx.get(served.url + "/ui/../manifest.py").status_code == 404


def test_models_page_lists_models_and_unload_load_change_the_phase(served, page):
    page.goto(served.url + "/")
    demo, tiny = row(page, "demo"), row(page, "tiny")
    demo.locator(".phase", has_text="Ready").wait_for()
    assert "default" in demo.inner_text() and "builtin:demo" in demo.inner_text()
    tiny.locator(".phase", has_text="Unloaded").wait_for()
    not_blank(page, "models")
    tiny.get_by_role("button", name="Load", exact=True).click()
    tiny.locator(".phase", has_text="Ready").wait_for(timeout=60000)
    assert served.status("tiny")["ready"]
    tiny.get_by_role("button", name="Unload", exact=True).click()
    tiny.locator(".phase", has_text="Unloaded").wait_for(timeout=60000)
    assert not served.status("tiny")["loaded"]


def test_model_detail_shows_conditions_events_and_the_log(served, page):
    page.goto(served.url + "/#model/demo")
    page.locator("#detail-conditions", has_text="WorkerReady").wait_for()
    page.locator("#detail-events", has_text="Ready").wait_for()
    page.locator("#detail-log", has_text="starting worker demo").wait_for()
    served.chat("demo")  # a request while the page follows the log: its line appears
    page.locator("#detail-log", has_text="completion tokens").wait_for()
    not_blank(page, "detail")


def test_apply_a_manifest_and_see_a_broken_ones_error(served, page):
    page.goto(served.url + "/")
    row(page, "demo").wait_for()
    page.click("#apply-open")
    page.fill("#apply-text", manifest("applied", source="builtin:tiny", preload=False))
    page.click("#apply-submit")
    page.locator("#apply-result", has_text="applied").wait_for()
    row(page, "applied").wait_for(timeout=30000)
    assert any("name: applied" in p.read_text() for p in served.dir.glob("*.yaml"))
    page.fill("#apply-text", "apiVersion: mlxfleet/v1\nkind: Model\nmetadata: {name: bad}\n"
                             "spec: {sourc: builtin:tiny}\n")
    page.click("#apply-submit")
    err = page.locator("#apply-errors")
    err.wait_for()
    assert "source" in err.inner_text()  # the server's own message, shown inline
    not_blank(page, "apply-error")
    page.once("dialog", lambda d: d.accept())  # "Delete model applied?"
    row(page, "applied").get_by_role("button", name="Delete").click()
    row(page, "applied").wait_for(state="detached", timeout=30000)


def test_chat_streams_an_answer_with_tokens_and_speed(served, page):
    page.goto(served.url + "/#chat")
    page.locator("#chat-model option[value='demo']").wait_for(state="attached")
    page.select_option("#chat-model", "demo")
    page.fill("#chat-temp", "0")
    page.fill("#chat-input", "What is the capital of Japan?")
    page.press("#chat-input", "Enter")
    answer = page.locator(".msg.assistant").last
    answer.locator(".meta").wait_for(timeout=60000)
    assert "Tokyo" in answer.locator(".body").inner_text()
    meta = answer.locator(".meta").inner_text()
    assert "tokens" in meta and "tok/s" in meta and "stop" in meta
    not_blank(page, "chat")


def test_requests_and_metrics_pages_render(served, page):
    page.goto(served.url + "/#requests")
    page.locator("#requests-empty").wait_for()
    page.goto(served.url + "/#metrics")
    page.wait_for_timeout(2500)  # a few samples
    not_blank(page, "metrics")


def test_phone_width_and_dark_mode(served, browser, tmp_path):
    ctx = browser.new_context(viewport={"width": 390, "height": 844}, color_scheme="dark")
    pg = ctx.new_page()
    pg.shots = tmp_path
    pg.goto(served.url + "/")
    row(pg, "demo").wait_for()
    bg = pg.evaluate("getComputedStyle(document.documentElement).backgroundColor")
    assert bg in ("rgb(22, 22, 24)",), bg  # the dark palette
    width = pg.evaluate("document.documentElement.scrollWidth")
    assert width <= 390 + 1, f"the page scrolls sideways on a phone ({width}px)"
    not_blank(pg, "phone-dark")
    ctx.close()


def test_api_key_is_asked_and_no_data_shown_before(tmp_path_factory, browser, tmp_path):
    f = Served(tmp_path_factory.mktemp("dashkey"), env={"MLXFLEET_API_KEY": KEY})
    f.write("tiny.yaml", manifest("tiny", preload=False))
    f.start()
    try:
        ctx = browser.new_context()
        pg = ctx.new_page()
        pg.shots = tmp_path
        pg.goto(f.url + "/")
        dialog = pg.locator("#key-dialog")
        dialog.wait_for()
        assert pg.locator("#models-table tbody tr").count() == 0
        pg.fill("#key-input", "wrong")
        pg.click("#key-form button")
        pg.locator("#key-error", has_text="refused").wait_for()
        assert pg.locator("#models-table tbody tr").count() == 0
        pg.fill("#key-input", KEY)
        pg.click("#key-form button")
        row(pg, "tiny").wait_for()
        assert pg.evaluate("sessionStorage.getItem('mlxfleet.apiKey')") == KEY
        not_blank(pg, "keyed")
        ctx.close()
    finally:
        f.stop()
