"""The endpoints evaluation tools use: /tokenize, /detokenize, /tokenizer_info, /v1/models/{id}, batched
completions and echo with prompt logprobs; then lm-evaluation-harness itself against the server."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tokenizers import processors

from engine.outputs import ChoiceOutput
from web.logprobs import TokenText
from web.responses import CompletionResponses, EchoedPrompt

from tests.support.engine_helpers import hf_model
from tests.support.server_harness import REPO, ThreadedServer, llm_engine_loader, tiny_engine_config
from tests.support.tiny_models import build_tokenizer


MODEL = "tiny"
KEY = "sk-eval"
ITEMS = [
    {"question": "The quick brown", "choices": [" fox", " dog", " cat"], "answer": 0},
    {"question": "Paged attention stores keys and values in", "choices": [" fixed-size blocks.", " the lazy dog.",
                                                                         " Zürich."], "answer": 0},  # fmt: skip
    {"question": "Hello world! Streaming tokens over", "choices": [" server-sent events", " 中文文本"], "answer": 0},
    {"question": "def add(a, b):\n   ", "choices": [" return a + b", " return a - b", " pass"], "answer": 0},
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ThreadedServer]:
    config = tiny_engine_config(tiny_llama_dir, enable_prefix_caching=True)
    with ThreadedServer(llm_engine_loader(config), served_model_name=MODEL, api_key=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def http(server: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def reference_scores(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V] float32 log-softmax: row i is the distribution of the token at position i + 1."""
    with torch.inference_mode():
        logits = hf_model(str(model_dir))(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def completion(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


# ---- tokenizer endpoints ----------------------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(server: ThreadedServer, http: httpx.Client) -> None:
    tokenizer = server.async_engine.tokenizer
    text = "Hello world! 😀 café"
    body = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=True) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] == server.async_engine.max_model_len
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "model": MODEL}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": plain["tokens"]}).json() == {"prompt": text}

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert chat[: len(bare)] == bare and len(bare) < len(chat)
    # with tools, the prompt a chat request with them has (here the tiny template's generic mode: a system prompt)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with_tools = http.post("/tokenize", json={"messages": messages, "tools": tools}).json()["count"]
    answer = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 1})
    assert with_tools == answer.json()["usage"]["prompt_tokens"] > len(chat)


def test_tokenizer_endpoints_refuse_bad_input(http: httpx.Client) -> None:
    cases = [
        ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        # the messages chat refuses, as chat refuses them
        ("/tokenize", {"messages": [{"role": "user", "content": "y"}, {"role": "assistant"}]}, 400, "messages.1.content"),
        ("/tokenize", {"messages": [{"role": "tool", "content": "42"}]}, 400, "messages.0.tool_call_id"),
    ]
    for path, body, status, param in cases:
        response = http.post(path, json=body)
        assert response.status_code == status, (path, body, response.text)
        assert response.json()["error"]["param"] == param


def test_tokenizer_info_and_retrieving_the_model(server: ThreadedServer, http: httpx.Client) -> None:
    info = http.get("/tokenizer_info").json()
    tokenizer = server.async_engine.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert http.get(f"/v1/models/{MODEL}").json() == http.get("/v1/models").json()["data"][0]
    missing = http.get("/v1/models/org/other-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.base_url}/tokenizer_info").status_code == 401  # keys cover these too


# ---- batches and echo -------------------------------------------------------------------------------------
def test_a_batch_of_prompts_gets_one_choice_each_equal_to_its_request_alone(http: httpx.Client) -> None:
    tokens = http.post("/tokenize", json={"prompt": "Continuous batching"}).json()["tokens"]
    prompts: list[Any] = ["The quick brown fox", "Hello world", "Paged attention"]
    for batch in (prompts, [tokens, tokens[:2], [5, 6, 7]]):
        together = completion(http, prompt=batch, max_tokens=6, ignore_eos=True)
        assert [c["index"] for c in together["choices"]] == list(range(len(batch)))
        alone = [completion(http, prompt=p, max_tokens=6, ignore_eos=True) for p in batch]
        assert [c["text"] for c in together["choices"]] == [a["choices"][0]["text"] for a in alone]
        assert together["usage"]["completion_tokens"] == 6 * len(batch)
        assert together["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)


def test_echo_returns_the_prompt_with_the_logprob_of_every_prompt_token(
    server: ThreadedServer, http: httpx.Client, tiny_llama_dir: Path
) -> None:
    prompt = http.post("/tokenize", json={"prompt": "Paged attention stores keys and values in blocks"}).json()["tokens"]
    body = completion(http, prompt=[prompt], max_tokens=1, logprobs=2, echo=True)
    (choice,) = body["choices"]
    logprobs = choice["logprobs"]
    n = len(prompt)
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == n + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert choice["text"].startswith(http.post("/detokenize", json={"tokens": prompt}).json()["prompt"])
    table = reference_scores(tiny_llama_dir, prompt)
    expected = table.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs["token_logprobs"][1:n]), expected, atol=2e-4, rtol=1e-4)
    for row, token, top in zip(table, logprobs["tokens"][1:n], logprobs["top_logprobs"][1:n]):  # the token among them
        assert len(top) in (2, 3) and token in top and max(top.values()) == pytest.approx(row.max().item(), abs=2e-4)
    assert body["usage"]["prompt_tokens"] == n and body["usage"]["completion_tokens"] == 1

    # The prompt is in the prefix cache now: scoring it again computes every position all the same.
    again = completion(http, prompt=prompt, max_tokens=1, logprobs=2, echo=True)
    assert again["choices"][0]["logprobs"]["token_logprobs"] == logprobs["token_logprobs"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = completion(http, prompt=prompt, max_tokens=1)
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_an_echoed_prompts_text_offsets_give_no_characters_to_the_bos_its_text_does_not_show() -> None:
    """A tokenizer that puts a BOS before every text (Gemma's, Llama's): the echoed text is the prompt as sent."""
    tokenizer = build_tokenizer()
    bos = ("<|endoftext|>", tokenizer.bos_token_id)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos[0]} $A", special_tokens=[bos])
    token_text = TokenText(tokenizer)
    assert token_text.num_added_to_text == (1, 0)
    ids = tokenizer.encode("Hello world")
    echo = EchoedPrompt("Hello world", ids, *token_text.num_added_to_text)
    body = CompletionResponses("tiny", token_text, True, False).batch_response([[ChoiceOutput(0)]], [echo])
    logprobs = body["choices"][0]["logprobs"]
    pieces = logprobs["tokens"]
    assert ids[0] == tokenizer.bos_token_id and "".join(pieces[1:]) == body["choices"][0]["text"] == "Hello world"
    assert logprobs["text_offset"] == [0] + [len("".join(pieces[1:i])) for i in range(1, len(pieces))]


def test_the_cached_token_texts_are_left_alone_by_the_collector() -> None:
    """The cache fills up to the vocabulary: entries the collector tracks made every full collection walk them all."""
    tokenizer = build_tokenizer()
    token_text = TokenText(tokenizer)
    entries = [token_text(token_id) for token_id in range(min(200, len(tokenizer)))]
    gc.collect()
    assert entries and not any(gc.is_tracked(entry) for entry in entries)
    text, raw = token_text(tokenizer.encode("Hello", add_special_tokens=False)[0])
    assert raw == text.encode() and isinstance(raw, bytes)


def test_echo_without_logprobs_and_refusals(http: httpx.Client) -> None:
    body = completion(http, prompt=["Hello world", "The quick"], max_tokens=3, echo=True, ignore_eos=True)
    plain = completion(http, prompt=["Hello world", "The quick"], max_tokens=3, ignore_eos=True)
    for echoed, alone, prompt in zip(body["choices"], plain["choices"], ["Hello world", "The quick"]):
        assert echoed["text"] == prompt + alone["text"] and echoed["logprobs"] is None
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "stream": True, "echo": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"
    too_many = http.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 257})  # max_pending is 256
    assert too_many.status_code == 400 and "max_pending" in too_many.json()["error"]["message"]


# ---- lm-evaluation-harness --------------------------------------------------------------------------------
def write_task(directory: Path) -> None:
    data = directory / "items.jsonl"
    data.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in ITEMS))
    (directory / "sluice_tiny.yaml").write_text(
        "task: sluice_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: choices\ndoc_to_target: answer\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n"
    )


def reference_loglikelihood(model_dir: Path, tokenizer: Any, context: str, continuation: str) -> tuple[float, bool]:
    """lm-evaluation-harness's own split of a pair into tokens, scored by the transformers model."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    num_context = len(tokenizer.encode(context, add_special_tokens=False))
    table = reference_scores(model_dir, whole)[num_context - 1 :]
    targets = torch.tensor(whole[num_context:])
    scores = table.gather(1, targets.unsqueeze(1)).squeeze(1)
    return scores.sum().item(), bool((table.argmax(dim=-1) == targets).all())


@pytest.mark.parametrize("tokenizer_backend", ["huggingface", "remote"])
def test_lm_evaluation_harness_scores_match_the_reference_model(
    server: ThreadedServer, tiny_llama_dir: Path, tmp_path: Path, tokenizer_backend: str
) -> None:
    write_task(tmp_path)
    model_args = f"base_url={server.base_url}/v1/completions,model={MODEL},num_concurrent=2,max_retries=1"
    if tokenizer_backend == "huggingface":
        model_args += f",tokenizer_backend=huggingface,tokenizer={tiny_llama_dir}"  # a local path: no hub
    else:
        model_args += f",tokenizer_backend=remote,auth_token={KEY}"  # /tokenizer_info, /tokenize, /detokenize
    out = tmp_path / "out"
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
               "--batch_size", "4", "--tasks", "sluice_tiny", "--include_path", str(tmp_path),
               "--output_path", str(out), "--log_samples"]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (samples_file,) = out.rglob("samples_sluice_tiny_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == len(ITEMS)
    tokenizer = server.async_engine.tokenizer
    for sample in samples:
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        for (context, continuation), ((loglikelihood, is_greedy),) in zip(pairs, sample["resps"]):
            expected, expected_greedy = reference_loglikelihood(tiny_llama_dir, tokenizer, context, continuation)
            assert float(loglikelihood) == pytest.approx(expected, abs=2e-3), (context, continuation)
            assert (is_greedy == "True") == expected_greedy
