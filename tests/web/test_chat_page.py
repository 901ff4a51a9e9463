"""The chat page in a real headless Chromium, against a real server on the default model with an API key."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement

from engine.config import EngineConfig

from tests.support.browser import headless_chromium
from tests.support.server_harness import ThreadedServer, health, llm_engine_loader, wait_until

MODEL = "smollm2"
KEY = "sk-page-test"
QUESTION = "What is the capital of France?"
LONG_REQUEST = "Write a very long story about a dragon who learns to bake bread."


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    # Prefix caching off: the page's greedy answer is compared with a second request's.
    config = EngineConfig(model="", num_kv_blocks=512, max_num_seqs=4, enable_prefix_caching=False)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL, api_key=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def page(server: ThreadedServer) -> Iterator[WebDriver]:
    with headless_chromium() as driver:
        driver.get(f"{server.base_url}/")
        yield driver


def by_id(page: WebDriver, element_id: str) -> WebElement:
    return page.find_element(By.ID, element_id)


def set_value(page: WebDriver, element_id: str, value: str) -> None:
    field = by_id(page, element_id)
    field.clear()
    field.send_keys(value)


def assistant_answers(page: WebDriver) -> list[WebElement]:
    return page.find_elements(By.CSS_SELECTOR, ".message.assistant")


def send(page: WebDriver, message: str) -> WebElement:
    num_before = len(assistant_answers(page))
    set_value(page, "prompt", message)
    by_id(page, "send").click()
    wait_until(lambda: len(assistant_answers(page)) == num_before + 1, timeout=10)
    return assistant_answers(page)[-1]


def text_of(answer: WebElement) -> str:
    return answer.find_element(By.CSS_SELECTOR, ".text").get_property("textContent")


def engine_idle(base_url: str) -> bool:
    status, state = health(base_url)
    return status == 200 and state["running"] == state["waiting"] == state["pending"] == 0


def aborted_total(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    line = next(line for line in text.splitlines() if line.startswith("sluice_requests_aborted_total "))
    return float(line.split()[1])


def test_page_loads_without_a_key_and_asks_for_one(page: WebDriver) -> None:
    wait_until(lambda: by_id(page, "status").text == "API key needed", timeout=30)
    assert by_id(page, "settings").get_property("open")
    assert "needs-attention" in by_id(page, "api-key").get_attribute("class")
    set_value(page, "prompt", QUESTION)
    by_id(page, "send").click()
    wait_until(lambda: page.find_elements(By.CSS_SELECTOR, ".message.error"), timeout=10)
    assert "API key" in page.find_elements(By.CSS_SELECTOR, ".message.error")[-1].text
    assert assistant_answers(page) == []  # nothing was generated: no empty answer is left behind
    assert by_id(page, "send").is_enabled() and not by_id(page, "stop").is_enabled()


def test_answer_streams_in_with_figures_and_equals_the_api_answer(server: ThreadedServer, page: WebDriver) -> None:
    by_id(page, "new-chat").click()
    set_value(page, "api-key", KEY)
    set_value(page, "temperature", "0")
    set_value(page, "max-tokens", "24")
    answer = send(page, QUESTION)
    wait_until(lambda: answer.get_attribute("data-finish-reason") is not None, timeout=60)
    figures = answer.find_element(By.CSS_SELECTOR, ".figures").text
    assert "TTFT" in figures and "tok/s" in figures and "finish: " in figures, figures
    assert by_id(page, "model").text == MODEL
    assert by_id(page, "status").text.startswith("ready")

    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 0}
    expected = httpx.post(
        f"{server.base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ).json()
    choice = expected["choices"][0]
    assert text_of(answer) == choice["message"]["content"]
    assert f"finish: {choice['finish_reason']}" in figures
    assert f"{expected['usage']['completion_tokens']} tokens" in figures
    assert by_id(page, "api-key").get_property("value") == KEY
    assert page.execute_script("return localStorage.getItem('sluice.api-key')") == KEY


def test_stop_mid_answer_frees_the_request_at_once(server: ThreadedServer, page: WebDriver, tmp_path: Path) -> None:
    by_id(page, "new-chat").click()
    set_value(page, "max-tokens", "3000")
    aborted_before = aborted_total(server.base_url)
    answer = send(page, LONG_REQUEST)
    seen: list[str] = []

    def streamed_twice() -> bool:
        text = text_of(answer)
        if text and (not seen or text != seen[-1]):
            seen.append(text)
        return len(seen) >= 3

    wait_until(streamed_twice, timeout=60, interval=0.01)
    assert answer.get_attribute("data-finish-reason") is None, "the answer ended before Stop"
    assert seen[0] != seen[-1] and seen[-1].startswith(seen[0])  # text grows as tokens arrive
    assert health(server.base_url)[1]["running"] == 1
    by_id(page, "stop").click()
    stopped_at = time.monotonic()
    wait_until(lambda: engine_idle(server.base_url), timeout=5)
    freed_after = time.monotonic() - stopped_at
    wait_until(lambda: answer.get_attribute("data-finish-reason") == "stopped", timeout=5)
    assert aborted_total(server.base_url) == aborted_before + 1
    state = health(server.base_url)[1]
    assert state["running"] == 0 and state["waiting"] == 0 and state["free_kv_blocks"] == state["total_kv_blocks"]
    text_at_stop = text_of(answer)
    time.sleep(0.3)
    assert text_of(answer) == text_at_stop  # nothing arrives after Stop
    assert "finish: stopped" in answer.find_element(By.CSS_SELECTOR, ".figures").text
    assert by_id(page, "send").is_enabled() and not by_id(page, "stop").is_enabled()
    assert freed_after < 2.0, f"the request was freed {freed_after:.2f} s after Stop"
    screenshot = tmp_path / "chat-page.png"
    assert page.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000


MARKUP = '<img src=x onerror="window.pwned=1"><b>bold</b>'
# One response body holding a whole stream whose content is markup, served to the page in place of the server's.
HOSTILE_STREAM_JS = """
const markup = arguments[0];
const realFetch = window.fetch;
window.fetch = async (url, init) => {
  if (!String(url).endsWith("/v1/chat/completions")) return realFetch(url, init);
  window.fetch = realFetch;
  const chunk = (delta, finish) => ({choices: [{index: 0, delta, finish_reason: finish}]});
  const events = [chunk({role: "assistant", content: ""}, null), chunk({content: markup.slice(0, 9)}, null),
                  chunk({content: markup.slice(9)}, null), chunk({}, "stop")];
  const body = events.map((e) => "data: " + JSON.stringify(e) + "\\r\\n\\r\\n").join("") + "data: [DONE]\\n\\n";
  return new Response(body, {status: 200, headers: {"Content-Type": "text/event-stream"}});
};
"""


def test_markup_in_messages_and_model_output_stays_text(page: WebDriver) -> None:
    page.execute_script(HOSTILE_STREAM_JS, MARKUP)
    answer = send(page, MARKUP)
    wait_until(lambda: answer.get_attribute("data-finish-reason") == "stop", timeout=10)
    assert text_of(answer) == MARKUP
    assert page.find_elements(By.CSS_SELECTOR, ".message.user .text")[-1].get_property("textContent") == MARKUP
    assert page.find_elements(By.CSS_SELECTOR, "#conversation img, #conversation b") == []
    assert page.execute_script("return window.pwned") is None


# Records the messages of every chat request the page sends; a request whose body asks for "silence" gets a stream
# that never sends a token (until the page aborts it), as a server busy with a long prefill would.
RECORDING_FETCH_JS = """
window.sentMessages = [];
const realFetch = window.fetch;
window.fetch = async (url, init) => {
  if (!String(url).endsWith("/v1/chat/completions")) return realFetch(url, init);
  const messages = JSON.parse(init.body).messages;
  window.sentMessages.push(messages);
  if (!messages[messages.length - 1].content.includes("silence")) return realFetch(url, init);
  const body = new ReadableStream({start(c) { init.signal.addEventListener("abort", () =>
    c.error(new DOMException("aborted", "AbortError"))); }});
  return new Response(body, {status: 200, headers: {"Content-Type": "text/event-stream"}});
};
"""


def test_stopped_and_abandoned_answers_keep_the_history_the_user_sees(page: WebDriver) -> None:
    """Roles alternate after an answer stopped before its first token (Gemma's template refuses two user turns),
    and New chat during an answer starts an empty conversation (the old answer's end must not land in it)."""
    by_id(page, "new-chat").click()
    set_value(page, "max-tokens", "3000")
    page.execute_script(RECORDING_FETCH_JS)
    silent = send(page, "silence please")
    time.sleep(0.3)
    by_id(page, "stop").click()
    wait_until(lambda: silent.get_attribute("data-finish-reason") == "stopped", timeout=5)
    set_value(page, "max-tokens", "4")
    hello = send(page, "Hello")
    wait_until(lambda: hello.get_attribute("data-finish-reason") is not None, timeout=30)
    roles = [m["role"] for m in page.execute_script("return window.sentMessages")[-1] if m["role"] != "system"]
    assert roles == ["user", "assistant", "user"]
    set_value(page, "max-tokens", "3000")
    long_answer = send(page, LONG_REQUEST)
    wait_until(lambda: text_of(long_answer) != "", timeout=60, interval=0.02)
    by_id(page, "new-chat").click()
    set_value(page, "max-tokens", "4")
    answer = send(page, "Hi")
    wait_until(lambda: answer.get_attribute("data-finish-reason") is not None, timeout=30)
    last = page.execute_script("return window.sentMessages")[-1]
    assert [(m["role"], m["content"]) for m in last if m["role"] != "system"] == [("user", "Hi")]


def test_narrow_window_has_no_horizontal_scroll(page: WebDriver, tmp_path: Path) -> None:
    page.set_window_size(380, 800)
    try:
        overflow = page.execute_script("return document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0
        assert by_id(page, "send").is_displayed() and by_id(page, "stop").is_displayed()
        page.save_screenshot(str(tmp_path / "chat-page-narrow.png"))
    finally:
        page.set_window_size(900, 900)
