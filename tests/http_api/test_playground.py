"""The playground (GET / of the HTTP API) in a real headless browser: Debian's chromium,
driven through its chromedriver by Selenium (`make setup` installs both; no browser
download). It loads, a prompt streams text, and each token carries the class of how it
was produced; the page's text equals the API's answer to the same request. Compare runs
the request with speculation, then with the target alone, and shows both speeds, their
ratio and whether the greedy outputs are identical.

    PLAYGROUND_SCREENSHOT=docs/playground.png .venv/bin/python -m pytest -m slow tests/http_api/test_playground.py

makes the committed screenshot (SmolLM2-135M and the n-gram drafter, as `make run`,
after a Compare).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from pathlib import Path

import pytest

from tests.local_system import LocalSystem

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="needs Debian's chromium and chromium-driver: run `make setup`",
)
SOURCES = {"accepted", "recovered", "bonus", "target"}
MODEL = "tiny-random:1"


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1100,1000",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def tiny_system():
    """Target and draft the same tiny random model: every draft token is accepted."""
    with LocalSystem(draft_model=MODEL, http_port=0) as system:
        yield system


def _fill(
    driver,
    url: str,
    prompt: str,
    k: int,
    drafter: str,
    max_tokens: int,
    temperature: float = 0,
    seed: str = "",
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    if driver.current_url.rstrip("/") != url.rstrip("/"):
        driver.get(url + "/")
    WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
    for field, value in (
        ("prompt", prompt),
        ("k", str(k)),
        ("max_tokens", str(max_tokens)),
        ("temperature", str(temperature)),
        ("seed", seed),
    ):
        element = driver.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    Select(driver.find_element(By.ID, "drafter")).select_by_value(drafter)


def _click(driver, button: str, timeout_s: float) -> str:
    """Clicks Generate or Compare and waits for it to end; returns the page's state."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element(By.ID, button).click()
    WebDriverWait(driver, timeout_s).until(
        lambda d: (
            d.find_element(By.TAG_NAME, "body").get_attribute("data-state") in ("done", "error")
        )
    )
    return driver.find_element(By.TAG_NAME, "body").get_attribute("data-state")


def _tokens(driver) -> list[tuple[str, str, str]]:
    """The tokens shown as (text, source, class)."""
    from selenium.webdriver.common.by import By

    spans = driver.find_elements(By.CSS_SELECTOR, "#output span")
    return [
        (
            span.get_attribute("textContent"),
            span.get_attribute("data-source"),
            span.get_attribute("class"),
        )
        for span in spans
    ]


def _generate(
    driver, url: str, prompt: str, k: int, drafter: str, max_tokens: int, timeout_s: float = 120
):
    """Fills the form, clicks Generate, waits for the stream to end; returns the tokens
    shown as (text, source, class)."""
    from selenium.webdriver.common.by import By

    _fill(driver, url, prompt, k, drafter, max_tokens)
    _click(driver, "generate", timeout_s)
    assert driver.find_element(By.ID, "error").text == ""
    return _tokens(driver)


def _compare(
    driver,
    url: str,
    prompt: str,
    k: int,
    drafter: str,
    max_tokens: int,
    temperature: float = 0,
    seed: str = "",
    timeout_s: float = 120,
) -> dict[str, str]:
    """Fills the form, clicks Compare, waits for both runs to end; returns the
    comparison's cells (speculative, target, ratio, identical) as shown."""
    from selenium.webdriver.common.by import By

    _fill(driver, url, prompt, k, drafter, max_tokens, temperature, seed)
    assert _click(driver, "compare", timeout_s) == "done", driver.find_element(By.ID, "error").text
    assert driver.find_element(By.ID, "error").text == ""
    assert driver.find_element(By.ID, "comparison").is_displayed()
    return {
        name: driver.find_element(By.ID, f"c-{name}").text
        for name in ("speculative", "target", "ratio", "identical")
    }


def _speeds(cells: dict[str, str]) -> tuple[float, float, float]:
    """Both tokens/s and the ratio, checked: positive, and the ratio their quotient
    within the rounding of what is shown (tokens/s to 0.1, the ratio to 0.01)."""
    speculative, target = float(cells["speculative"]), float(cells["target"])
    assert speculative > 0 and target > 0, cells
    match = re.fullmatch(r"(\d+\.\d\d)x", cells["ratio"])
    assert match, cells
    ratio = float(match.group(1))
    low, high = (speculative - 0.05) / (target + 0.05), (speculative + 0.05) / (target - 0.05)
    assert low - 0.005 <= ratio <= high + 0.005, cells
    return speculative, target, ratio


def _api(url: str, prompt: str, k: int, drafter: str, max_tokens: int) -> str:
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "num_speculative_tokens": k,
            "drafter": drafter,
        }
    ).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())["choices"][0]["message"]["content"]


def test_playground_streams_tokens_with_their_provenance(browser, tiny_system, tmp_path):
    from selenium.webdriver.common.by import By

    url = tiny_system.http_url
    browser.get(url + "/")
    assert "playground" in browser.title
    prompt = "abcabcabc: say it again"
    # The draft is the target itself: every draft token accepted, a bonus token per
    # round; only a last round left one token of room (proposals drafted ahead end
    # where their verdict comes) is the target's plain step.
    tokens = _generate(browser, url, prompt, 4, "model", 40)
    assert tokens and all(source in SOURCES and css == f"tok-{source}" for _, source, css in tokens)
    assert {source for _, source, _ in tokens[:-1]} == {"accepted", "bonus"}
    assert tokens[-1][1] in ("bonus", "target")
    assert "".join(text for text, _, _ in tokens) == _api(url, prompt, 4, "model", 40)
    assert browser.find_element(By.ID, "s-acceptance").text == "100%"
    assert float(browser.find_element(By.ID, "s-rate").text) > 0
    assert browser.find_element(By.ID, "s-finish").text in ("length", "stop")
    browser.save_screenshot(str(tmp_path / "playground.png"))
    # k = 0: the target decodes alone.
    tokens = _generate(browser, url, prompt, 0, "", 16)
    assert tokens and {source for _, source, _ in tokens} == {"target"}
    assert "".join(text for text, _, _ in tokens) == _api(url, prompt, 0, "", 16)


def test_playground_compare_shows_both_speeds_and_identical_greedy_outputs(browser, tiny_system):
    from selenium.webdriver.common.by import By

    url = tiny_system.http_url
    prompt = "abcabcabc: say it again"
    cells = _compare(browser, url, prompt, 4, "model", 40)
    _speeds(cells)
    assert cells["identical"] == "identical"
    # The speculative run is the one shown, and its text is the target's alone.
    tokens = _tokens(browser)
    assert "accepted" in {source for _, source, _ in tokens}
    assert "".join(text for text, _, _ in tokens) == _api(url, prompt, 0, "", 40)
    assert browser.find_element(By.ID, "s-acceptance").text == "100%"


def test_playground_compare_sampled_and_refused(browser, tiny_system):
    from selenium.webdriver.common.by import By

    url = tiny_system.http_url
    prompt = "abcabcabc: say it again"
    # Sampled: the same distribution, not the same tokens, so not compared.
    cells = _compare(browser, url, prompt, 4, "model", 24, temperature=0.8, seed="7")
    _speeds(cells)
    assert cells["identical"] == "sampled: not compared"
    # A refused request (max_tokens past the context) is shown, naming the run.
    _fill(browser, url, prompt, 4, "model", 10**7)
    assert _click(browser, "compare", 120) == "error"
    error = browser.find_element(By.ID, "error").text
    assert error.startswith("with speculation: 400: ") and "max_new_tokens" in error, error
    assert browser.find_element(By.ID, "c-speculative").text == "failed"
    assert browser.find_element(By.ID, "c-target").text == "–"
    assert browser.find_element(By.ID, "c-ratio").text == "–"
    # Generate puts the comparison away and clears the error.
    _generate(browser, url, prompt, 4, "model", 8)
    assert not browser.find_element(By.ID, "comparison").is_displayed()


@pytest.mark.slow
def test_playground_screenshot_with_smollm2(browser, tmp_path):
    """SmolLM2-135M with the n-gram drafter (`make run`'s system), compared with the
    target alone: a summary copies from its prompt, so drafts are accepted where it
    does and the target decodes alone where the drafter has nothing to propose."""
    with LocalSystem(target_model="smollm2-135m", draft_model="", http_port=0) as system:
        prompt = (
            "Summarize in one sentence: The city council met on Monday to discuss the new park. "
            "The council approved the park's budget and chose a site near the river."
        )
        cells = _compare(browser, system.http_url, prompt, 4, "ngram", 96, timeout_s=600)
        _speeds(cells)
        assert cells["identical"] == "identical"
        sources = {source for _, source, _ in _tokens(browser)}
        assert "accepted" in sources and sources <= SOURCES
        path = Path(os.environ.get("PLAYGROUND_SCREENSHOT") or tmp_path / "playground.png")
        browser.save_screenshot(str(path))
