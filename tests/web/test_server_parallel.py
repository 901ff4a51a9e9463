"""n > 1 and logit_bias over HTTP, through the official openai client: streaming and not, both endpoints."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.server_harness import ThreadedServer, llm_engine_loader, stream_request, tiny_engine_config, wait_until


MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Hello world"}]
PROMPT = "The quick brown fox jumps over the lazy dog again and again"
SEEDED = {"max_tokens": 10, "temperature": 1.0, "seed": 42}


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[ThreadedServer]:
    config = tiny_engine_config(tiny_llama_dir, block_size=4)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(autouse=True)
def every_block_comes_back(server: ThreadedServer) -> Iterator[None]:
    yield
    engine = server.engine
    wait_until(lambda: not engine.has_unfinished_requests and engine.num_free_blocks == engine.num_total_blocks)


def test_chat_n4_with_a_seed_is_reproducible_streamed_or_not(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=4, **SEEDED)
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=4, **SEEDED)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3] and len(set(texts)) == 4
    assert [c.message.content for c in again.choices] == texts
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in first.choices)
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, **SEEDED)
    assert single.choices[0].message.content == texts[0]  # choice i samples with seed + i
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert first.usage.completion_tokens == 4 * 10

    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=4, stream=True, stream_options={"include_usage": True}, **SEEDED
    )
    streamed: dict[int, str] = defaultdict(str)
    roles: dict[int, list[str]] = defaultdict(list)
    finishes: dict[int, list[str]] = defaultdict(list)
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        if choice.delta.role:
            roles[choice.index].append(choice.delta.role)
            assert not streamed[choice.index]  # the role comes first
        streamed[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert [streamed[i] for i in range(4)] == texts
    assert all(roles[i] == ["assistant"] and finishes[i] == ["length"] for i in range(4))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert chunks[-1].usage.prompt_tokens == single.usage.prompt_tokens


def test_completions_n3_streamed_equals_non_streamed(client: openai.OpenAI, http: httpx.Client) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **SEEDED)
    texts = [c.text for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert whole.usage.completion_tokens == 30
    result = stream_request(http, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 3, **SEEDED})
    assert result.events[-1] == "[DONE]" and result.events.count("[DONE]") == 1
    streamed: dict[int, str] = defaultdict(str)
    finishes = []
    for event in result.events[:-1]:
        (choice,) = event["choices"]
        streamed[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes.append(choice["index"])
    assert [streamed[i] for i in range(3)] == texts and sorted(finishes) == [0, 1, 2]


def test_a_batch_of_prompts_numbers_choices_prompt_by_prompt(client: openai.OpenAI) -> None:
    prompts = [PROMPT, "Once upon a time"]
    batch = client.completions.create(model=MODEL, prompt=prompts, n=2, **SEEDED)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, n=2, **SEEDED)
        assert [c.text for c in batch.choices[2 * p : 2 * p + 2]] == [c.text for c in alone.choices]


def test_a_client_that_leaves_an_n4_stream_frees_every_choice(server: ThreadedServer, http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "n": 4, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # and close the connection: the autouse fixture waits for every block to come back


def token_ids_with_text(server: ThreadedServer, text: str) -> list[int]:
    tokenizer = server.engine.tokenizer
    return [t for t in range(server.engine.vocab_size) if tokenizer.decode([t]) == text]


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_bans_and_forces_a_token(server: ThreadedServer, client: openai.OpenAI, stream: bool) -> None:
    def first_token_text(**kwargs) -> str:
        args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, **kwargs}
        if not stream:
            return client.completions.create(**args).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **args) if c.choices)

    greedy = first_token_text()
    banned = token_ids_with_text(server, greedy)
    assert banned and first_token_text(logit_bias={str(t): -100 for t in banned}) != greedy
    decode = server.engine.tokenizer.decode
    forced = next(t for t in range(100, 300) if decode([t]).strip().isalnum() and decode([t]) not in (greedy, ""))
    text = first_token_text(logit_bias={str(forced): 100}, max_tokens=5)
    assert text == server.engine.tokenizer.decode([forced] * 5)
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=1.0, logit_bias={str(forced): 100}
    )
    assert chat.choices[0].message.content == server.engine.tokenizer.decode([forced] * 3)
