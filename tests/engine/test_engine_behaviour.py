"""The step API and the offline API: sampling, UTF-8, stop strings, aborts, bad input, block accounting."""

import itertools
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.errors import InvalidRequest

from tests.support.engine_helpers import assert_pool_full, make_llm


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=16, temperature=1.2, ignore_eos=True)
    alone = llm.generate(["The quick brown fox"], seeded, use_tqdm=False)[0].token_ids
    batch = llm.generate(
        ["Hello world", "The quick brown fox", "def add(a, b):"] * 2, [other, seeded, other] * 2, use_tqdm=False
    )
    assert batch[1].token_ids == alone and batch[4].token_ids == alone
    different = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert llm.generate(["The quick brown fox"], different, use_tqdm=False)[0].token_ids != alone


def test_step_api_emits_one_delta_per_request_per_step_and_one_final(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request("a", "Hello world", params)
    engine.add_request("b", "The quick brown fox jumps", params)
    finals, tokens = {}, {"a": [], "b": []}
    while engine.has_unfinished_requests:
        outputs = engine.step()
        assert len({o.request_id for o in outputs}) == len(outputs)
        for o in outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                assert o.request_id not in finals
                finals[o.request_id] = o
    assert set(finals) == {"a", "b"} and all(f.finish_reason == "length" for f in finals.values())
    assert tokens["a"] and len(tokens["a"]) == 5 and finals["a"].num_output_tokens == 5


def test_abort_waiting_prefilling_and_decoding_frees_blocks(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request("decoding", "Hello world", params)
    engine.step()
    engine.step()
    engine.add_request("waiting", "The quick brown fox", params)
    (out,) = engine.abort("waiting")
    assert out.finished and out.finish_reason == "abort"
    assert engine.abort("waiting") == []  # idempotent
    (out,) = engine.abort("decoding")
    assert out.finish_reason == "abort" and engine.abort("decoding") == []
    assert engine.step() == []
    assert_pool_full(llm)


def test_abort_is_refused_during_a_forward_pass(llm):
    """The forward pass reads the step's blocks: aborts wait for the step boundary (the async shell queues them)."""
    engine = llm.engine
    engine.add_request("x", "Hello world", SamplingParams(max_tokens=3, ignore_eos=True))
    plan = engine.schedule_step()
    with pytest.raises(RuntimeError, match="between steps"):
        engine.abort("x")
    engine.finish_step(plan, engine.execute(plan))
    assert engine.abort("x")[0].finish_reason == "abort"


def test_forward_failure_ends_the_step_requests_with_error_and_frees_blocks(llm, caplog):
    engine = llm.engine
    engine.add_request("f", "Hello world", SamplingParams(max_tokens=4))
    plan = engine.schedule_step()
    outputs = engine.fail_step(plan, RuntimeError("boom at /secret/path"))
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("f", "error")]
    assert "boom" not in outputs[0].error and "/secret" not in outputs[0].error  # the client learns no internals
    assert "boom at /secret/path" in caplog.text  # the log does
    out = llm.generate(["still serving"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 3  # (a sampled EOS could end it sooner: ignored)


@pytest.mark.parametrize("error, finish_reason", [(RuntimeError("boom"), "error"), (KeyboardInterrupt(), "abort")])
def test_a_forward_pass_that_raises_ends_another_calls_stream(llm, monkeypatch, error, finish_reason):
    """A forward pass that raises (or is interrupted by Ctrl-C) while generate() steps the engine: generate raises,
    and a stream opened by another call whose request was in that step ends with an "error" (or "abort") delta: it
    ended silently, as if cut short. The engine serves on."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    stream = llm.stream([5, 6, 7], params)
    assert not next(stream).finished
    run = llm.engine.runner.run
    calls = []

    def fail_once(batch):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return run(batch)

    monkeypatch.setattr(llm.engine.runner, "run", fail_once)
    with pytest.raises(type(error)):
        llm.generate([[8, 9, 10]], params, use_tqdm=False)
    rest = list(stream)
    assert [d.finish_reason for d in rest] == [finish_reason]
    assert bool(rest[0].error) == (finish_reason == "error")
    assert len(llm.generate(["still serving"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].token_ids) == 3
    assert_pool_full(llm)


def test_an_output_failure_fails_that_request_alone(llm, monkeypatch):
    engine = llm.engine
    engine.add_request("bad", "Hello world", SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("good", "The quick brown fox", SamplingParams(max_tokens=6, ignore_eos=True))
    (bad_seq,) = engine.requests["bad"]

    def explode(token_id, can_stop=True):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    monkeypatch.setattr(bad_seq.detokenizer, "step", explode)
    finals = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].finish_reason == "error" and "injected" not in finals["bad"].error
    assert finals["good"].finish_reason == "length" and finals["good"].num_output_tokens == 6


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "non-empty"),
        ([1, 2, 10**6], SamplingParams(), "outside the vocabulary"),
        ([1, -3], SamplingParams(), "outside the vocabulary"),
        ([1, 2.0], SamplingParams(), "token ids are integers, not float (2.0)"),
        ([1, True], SamplingParams(), "token ids are integers, not bool (True)"),
        ("x " * 600, SamplingParams(max_tokens=4), "max_model_len"),
        ("hello", SamplingParams(max_tokens=600), "600 in max_tokens"),
        ("hello", SamplingParams(max_tokens=None, min_tokens=100_000), "min_tokens (100000)"),
        ("x" * 10**6, SamplingParams(max_tokens=4), "characters"),  # rejected before tokenization
        (list(range(10**6)), SamplingParams(max_tokens=4), "max_model_len"),
        ("hello", SamplingParams(stop_token_ids=[10**6]), "stop token id"),
        ("Hi \ud83d there", SamplingParams(), "not valid Unicode"),  # a lone surrogate (JSON's \ud83d)
    ],
)
def test_bad_input_raises_before_any_state_changes(llm, prompt, params, message):
    engine = llm.engine
    engine.add_request("bystander", "Hello world", SamplingParams(max_tokens=6, ignore_eos=True))
    before = (engine.num_waiting, engine.num_running, engine.num_free_blocks)
    try:
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.add_request("bad", prompt, params)
        assert (engine.num_waiting, engine.num_running, engine.num_free_blocks) == before
        assert "bad" not in engine.requests
    finally:
        while engine.has_unfinished_requests:
            engine.step()


def test_token_ids_may_come_as_numpy_or_torch_integers_and_a_request_id_is_a_string(llm):
    greedy = SamplingParams(max_tokens=3, temperature=0)
    expected = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].token_ids
    for prompts in (np.array([5, 6, 7]), [np.int64(5), np.int32(6), 7], torch.tensor([[5, 6, 7]])):
        assert llm.generate(prompts, greedy, use_tqdm=False)[0].token_ids == expected
    with pytest.raises(ValueError, match="request_id must be a string, not NoneType"):
        llm.engine.add_request(None, "Hello", greedy)
    assert not llm.engine.has_unfinished_requests


@pytest.mark.parametrize("prompts", [None, 5, {"prompt": "x"}])
def test_prompts_of_no_usable_type_raise_value_error(llm, prompts):
    with pytest.raises(ValueError, match="prompts must be a string, a list of token ids or a list of those"):
        llm.generate(prompts)


def test_length_errors_name_the_text_in_a_sentence(llm):
    context = r"^This model's maximum context length is \d+ tokens \(max_model_len\)\. However, "
    with pytest.raises(ValueError, match=context + r"the prompt has \d+ tokens"):
        llm.engine.add_request("long", "x " * 600, SamplingParams(max_tokens=4))
    processor = llm.engine.input_processor  # the server's chat path names its parameter "messages"
    with pytest.raises(ValueError, match=context + r"the messages have \d+ tokens"):
        processor.process_chat("long", [{"role": "user", "content": "x " * 600}], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=context + r"the messages have \d+ characters: more than"):
        processor.process_chat("long", [{"role": "user", "content": "x" * 10**6}], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests


def test_a_context_cut_to_the_kv_pool_says_so_in_its_errors(tiny_llama_dir):
    small = make_llm(tiny_llama_dir, num_kv_blocks=8, block_size=4)  # 32 tokens, under the model's positions
    assert small.engine.max_model_len == 32
    cut = r"^This model's maximum context length is 32 tokens \(max_model_len, cut to what the KV pool holds: " \
          r"num_kv_blocks 8 x block_size 4\)\. However, the prompt has \d+ tokens"  # fmt: skip
    with pytest.raises(ValueError, match=cut):
        small.generate(["x " * 40], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -0.5},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 2},
        {"logprobs": 21},
        {"stop": [""]},
        {"max_tokens": 2, "min_tokens": 3},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"repetition_penalty": float("inf")},
        {"presence_penalty": float("nan")},
        {"stop": ["x"] * 17},
        {"stop": ["x" * 257]},
        {"stop_token_ids": list(range(257))},
        {"ignore_eos": "false"},
        {"skip_special_tokens": None},
        {"include_stop_str_in_output": 1},
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_parameter(kwargs):
    with pytest.raises(InvalidRequest) as raised:
        SamplingParams(**kwargs)
    assert isinstance(raised.value, ValueError) and raised.value.param == list(kwargs)[-1]


def test_unknown_model_path_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="nonexistent"):
        make_llm(tmp_path / "nonexistent")


def test_duplicate_request_id(llm):
    llm.engine.add_request("dup", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already"):
        llm.engine.add_request("dup", "Hello", SamplingParams(max_tokens=2))
    llm.engine.abort("dup")


def test_min_tokens_and_stop_token_ids(llm):
    eos = next(iter(llm.engine.eos_token_ids))
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8, min_tokens=8, temperature=0), use_tqdm=False)[0]
    assert len(out.token_ids) == 8 and eos not in out.token_ids
    first = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    stop_id = first.token_ids[3]
    cut = llm.generate(
        ["Hello"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]), use_tqdm=False
    )[0]
    assert cut.token_ids == first.token_ids[: first.token_ids.index(stop_id) + 1]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_id


def test_eos_is_not_text_even_when_special_tokens_are_shown(default_llm):
    llm = default_llm
    eos = next(iter(llm.engine.eos_token_ids))
    eos_text = llm.tokenizer.decode([eos], skip_special_tokens=False)
    prompt = ["The capital of France is"]
    before = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    forced = dict(max_tokens=8, temperature=0, min_tokens=3, logit_bias={eos: 100}, skip_special_tokens=False)
    out = llm.generate(prompt, SamplingParams(**forced), use_tqdm=False)[0]
    assert out.token_ids == before.token_ids + [eos] and out.finish_reason == "stop"
    assert out.text == before.text and before.text.strip() and eos_text and eos_text not in out.text
    kept = llm.generate(prompt, SamplingParams(**forced, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == before.text + eos_text
    first = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    stop_id = before.token_ids[1]
    cut = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert cut.token_ids == before.token_ids[:2] and cut.text == first.text != before.text


def test_logprobs_are_returned_per_token(llm):
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, logprobs=3), use_tqdm=False)[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token_id and lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][0] == token_id  # greedy picks the most likely token


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    expected = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert llm.tokenizer.decode(out.prompt_token_ids) == expected
    with pytest.raises(ValueError):
        llm.chat([{"role": "user"}], SamplingParams(max_tokens=3), use_tqdm=False)
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    joined = llm.chat([{"role": "user", "content": "h\ni"}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert llm.chat(parts, SamplingParams(max_tokens=3), use_tqdm=False)[0].prompt_token_ids == joined.prompt_token_ids
    with pytest.raises(ValueError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], use_tqdm=False)
    started = [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "1, 2, 3,"}]
    out = llm.chat(started, SamplingParams(max_tokens=3), use_tqdm=False, continue_final_message=True)[0]
    expected = llm.tokenizer.apply_chat_template(started, continue_final_message=True, tokenize=False)
    assert llm.tokenizer.decode(out.prompt_token_ids) == expected and expected.endswith("1, 2, 3,")



def test_chat_template_kwargs_are_the_templates_variables(llm):
    conversation = [{"role": "user", "content": "hi"}]
    greedy = SamplingParams(max_tokens=2, temperature=0)
    out = llm.chat(conversation, greedy, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    expected = llm.tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert llm.tokenizer.decode(out.prompt_token_ids) == expected and "<think>" in expected
    streamed = llm.stream(conversation, greedy, chat_template_kwargs={"enable_thinking": False})
    assert [t for delta in streamed for t in delta.new_token_ids] == out.token_ids  # the same prompt
    for variables in [{"tokenize": False}, {"conversation": []}, {1: True}, "enable_thinking"]:
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            llm.chat(conversation, use_tqdm=False, chat_template_kwargs=variables)

def test_the_sampling_params_keyword_is_vllms(llm):
    """Code written for vLLM's LLM passes `sampling_params=` by name, to generate, chat and stream alike."""
    greedy = SamplingParams(max_tokens=4, temperature=0)
    by_position = llm.generate("hello", greedy, use_tqdm=False)[0]
    assert llm.generate("hello", sampling_params=greedy, use_tqdm=False)[0].token_ids == by_position.token_ids
    conversation = [{"role": "user", "content": "hi"}]
    chatted = llm.chat(conversation, sampling_params=greedy, use_tqdm=False)[0]
    assert chatted.token_ids == llm.chat(conversation, greedy, use_tqdm=False)[0].token_ids
    streamed = [t for delta in llm.stream("hello", sampling_params=greedy) for t in delta.new_token_ids]
    assert streamed == by_position.token_ids

# ---- the real default model: UTF-8 and stop strings on real text -----------------------------------------


def run_deltas(engine, request_id, prompt, params):
    engine.add_request(request_id, prompt, params)
    deltas, ids, final = [], [], None
    while engine.has_unfinished_requests:
        for o in engine.step():
            deltas.append(o.text_delta)
            ids += o.new_token_ids
            if o.finished:
                final = o
    return deltas, ids, final


@pytest.mark.parametrize(
    "messages",
    [
        "请用中文介绍一下你自己。",
        "Reply with three emoji that describe the ocean, like 🌊🐠🐚, and nothing else.",
        "日本語で「こんにちは」と言ってください。",
    ],
)
def test_utf8_deltas_are_well_formed_and_concatenate(default_llm, messages):
    engine = default_llm.engine
    prompt = engine.input_processor.encode_chat([{"role": "user", "content": messages}])
    params = SamplingParams(max_tokens=40, temperature=0)
    deltas, ids, final = run_deltas(engine, "utf8", prompt, params)
    for d in deltas:
        d.encode("utf-8")
        assert "\ufffd" not in d
    text = "".join(deltas)
    # A character that max_tokens cut off is dropped; a full decode would show it as U+FFFD.
    assert text == default_llm.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    assert final.finish_reason in ("stop", "length")


def test_stop_string_spanning_tokens_never_leaks_on_the_real_model(default_llm):
    engine = default_llm.engine
    prompt = engine.input_processor.encode_chat([{"role": "user", "content": "Tell me a short story about a dragon."}])
    greedy = SamplingParams(max_tokens=40, temperature=0)
    deltas, ids, _ = run_deltas(engine, "full", prompt, greedy)
    text = "".join(deltas)
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [default_llm.tokenizer.decode(ids[: i + 1], skip_special_tokens=True) for i in range(len(ids))]
    k = next(i for i in range(3, len(pieces)) if len(pieces[i]) - len(pieces[i - 1]) >= 3)
    start = len(pieces[k - 1]) - 2
    stop = text[start : len(pieces[k]) + 2]
    assert stop and text.find(stop) == start
    params = SamplingParams(max_tokens=40, temperature=0, stop=[stop])
    deltas, _, final = run_deltas(engine, "stopped", prompt, params)
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert "".join(deltas) == text[:start]
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


# ---- the offline API shared: several streams, several threads, Ctrl-C ----------------------------------------


def test_open_streams_and_threads_each_get_their_own_deltas(llm):
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 14)]
    alone = [llm.generate([p], q, use_tqdm=False)[0].token_ids for p, q in zip(("Hello", "The fox"), params)]
    streams = [llm.stream(p, q) for p, q in zip(("Hello", "The fox"), params)]
    tokens: list[list[int]] = [[], []]
    for deltas in itertools.zip_longest(*streams):  # read in turns: each step feeds both
        for i, delta in enumerate(deltas):
            if delta is not None:
                tokens[i] += delta.new_token_ids
    assert tokens == alone and [len(t) for t in tokens] == [6, 14]
    open_stream = llm.stream("Hello", params[1])
    first = next(open_stream).new_token_ids  # a stream left open while another call runs: neither loses a delta
    assert llm.generate(["The fox"], params[1], use_tqdm=False)[0].token_ids == alone[1]
    rest = [t for delta in open_stream for t in delta.new_token_ids]
    assert first + rest == llm.generate(["Hello"], params[1], use_tqdm=False)[0].token_ids
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda i: llm.generate(["Hello", "The fox"], params, use_tqdm=False), range(4)))
    assert all([r.token_ids for r in result] == alone for result in done)
    assert_pool_full(llm)


def test_ctrl_c_during_a_forward_pass_leaves_the_llm_usable(llm, monkeypatch):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [r.text for r in llm.generate(["Hello", "The fox"], params, use_tqdm=False)]
    run = llm.engine.runner.run
    calls = itertools.count()

    def interrupted(batch):  # the KeyboardInterrupt Python raises in the main thread at a signal
        if next(calls) == 3:
            raise KeyboardInterrupt
        return run(batch)

    monkeypatch.setattr(llm.engine.runner, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hello", "The fox"], params, use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.is_step_running
    assert_pool_full(llm)
    assert [r.text for r in llm.generate(["Hello", "The fox"], params, use_tqdm=False)] == expected
    calls = itertools.count()
    with pytest.raises(KeyboardInterrupt):
        list(llm.stream("Hello", params))
    assert_pool_full(llm)


def test_params_changed_after_construction_are_checked_when_added(llm):
    good = SamplingParams(max_tokens=4, temperature=0)
    bad = SamplingParams(max_tokens=4)
    bad.temperature = float("nan")
    with pytest.raises(InvalidRequest) as raised:
        llm.generate(["Hello", "The fox", "Hi"], [good, bad, good], use_tqdm=False)
    assert raised.value.param == "temperature"
    assert_pool_full(llm)
    assert len(llm.generate(["Hello"], good, use_tqdm=False)[0].token_ids) == 4


def test_params_changed_while_their_request_runs_do_not_reach_it(llm):
    """A request keeps the parameters it was added with: the caller's object may be changed, or reused for the next
    request, meanwhile (a NaN temperature set then failed the whole step, every request in it)."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=["zzz"])
    expected = llm.generate(["Hello world"], params, use_tqdm=False)[0].token_ids
    stream = llm.stream("Hello world", params)
    tokens = list(next(stream).new_token_ids)
    params.max_tokens, params.temperature = 2, float("nan")
    params.stop.append(llm.tokenizer.decode(expected[2:4]))
    for delta in stream:
        tokens += delta.new_token_ids
    assert tokens == expected
    assert_pool_full(llm)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"speculative_k": "4"}, "speculative_k must be an integer, got '4'"),
        ({"speculative_ngram_max": 2.5}, "speculative_ngram_max must be an integer, got 2.5"),
        ({"speculative": None}, "speculative must be one of"),
        ({"num_threads": "2"}, "num_threads must be an integer, got '2'"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be a boolean, got 'no'"),
        ({"model": 5}, "model must be a string or a path, got 5"),
    ],
)
def test_engine_settings_of_the_wrong_type_are_value_errors_naming_them(setting, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**setting)


def test_a_model_and_cache_folder_may_be_given_as_paths(tmp_path):
    config = EngineConfig(model=tmp_path / "m.gguf", cache_dir=tmp_path)
    assert config.model == str(tmp_path / "m.gguf") and config.cache_dir == str(tmp_path)


def test_a_conversation_that_is_not_unicode_text_is_named_as_such(llm):
    # A lone surrogate (JSON's "\ud83d" read by json.loads) reached the tokenizer, whose TypeError read as the chat
    # template's own refusal ("TextEncodeInput must be Union[...]").
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content is not valid Unicode text \(a lone surrogate\?\)$"):
        llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \ud83d"}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests
    assert llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids


def test_an_assistant_refusal_part_is_read_as_its_text_offline(llm):
    def prompt(reply):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply},
                    {"role": "user", "content": "why?"}]  # fmt: skip
        return llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids

    assert prompt([{"type": "refusal", "refusal": "I can't."}]) == prompt("I can't.")
    with pytest.raises(ValueError, match="text parts"):
        prompt([{"type": "refusal", "text": "I can't."}])
