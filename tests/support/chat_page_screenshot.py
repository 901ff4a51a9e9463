"""Make the README's picture of the chat page: a real server on the default model, a real headless Chromium.

    .venv/bin/python -m tests.support.chat_page_screenshot web/docs/chat-page.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from selenium.webdriver.common.by import By

from engine.config import EngineConfig

from tests.support.browser import headless_chromium
from tests.support.server_harness import ThreadedServer, llm_engine_loader, wait_until

QUESTIONS = ("What is the capital of France?", "Name three rivers that flow through it or near it.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--width", type=int, default=900)
    parser.add_argument("--height", type=int, default=820)
    args = parser.parse_args()
    config = EngineConfig(model="", num_kv_blocks=512, max_num_seqs=4)
    with ThreadedServer(llm_engine_loader(config)) as server, headless_chromium(args.width, args.height) as page:
        page.get(f"{server.base_url}/")
        wait_until(lambda: page.find_element(By.ID, "status").text.startswith("ready"), timeout=30)
        settings = page.find_element(By.CSS_SELECTOR, "#settings summary")
        settings.click()
        for element_id, value in (("temperature", "0"), ("max-tokens", "200")):
            field = page.find_element(By.ID, element_id)
            field.clear()
            field.send_keys(value)
        settings.click()
        for question in QUESTIONS:
            page.find_element(By.ID, "prompt").send_keys(question)
            page.find_element(By.ID, "send").click()
            wait_until(
                lambda: page.find_elements(By.CSS_SELECTOR, ".message.assistant")
                and page.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1].get_attribute("data-finish-reason"),
                timeout=120,
            )
        wait_until(lambda: "0 running" in page.find_element(By.ID, "status").text, timeout=10)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        page.save_screenshot(str(args.output))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
