"""The reasoning parsers (qwen3, deepseek_r1) as units: the splitter fed text deltas, and the detokenizer that holds a
partial marker back so that the splitter always sees markers whole."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.reasoning_parser import (REASONING_PARSERS, Phase, ReasoningSplitter, first_phase, marker_token_ids,
                                     reasoning_syntax, split_whole)  # fmt: skip
from tests.support.tiny_models import build_qwen3_tokenizer, build_tokenizer, save_tiny_llama

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
PLAIN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def split(syntax, deltas: list[str], prompt: str = PLAIN_PROMPT) -> tuple[str | None, str | None]:
    """Streamed: the deltas' pieces joined, None for a side that never had text (as the whole response's nulls)."""
    splitter = ReasoningSplitter(syntax, first_phase(syntax, prompt))
    pieces = [splitter.feed(d) for d in deltas] + [splitter.finish()]
    reasoning, content = "".join(r for r, _ in pieces), "".join(c for _, c in pieces)
    streamed = (reasoning if splitter.has_thought else None), (content or None)
    whole = split_whole(ReasoningSplitter(syntax, first_phase(syntax, prompt)), "".join(deltas), [])
    assert streamed == whole, (streamed, whole)  # streaming and the whole output agree
    return streamed


@pytest.mark.parametrize("deltas", [
    ["<think>", "\nI weigh it", "</think>", "\n\nYes."],
    ["<think>\nI weigh it</think>\n\nYes."],
    ["\n", "<think>\nI", " weigh it</think>", "\n\nYes."],  # whitespace before the thought: dropped
])  # fmt: skip
def test_a_thought_the_output_opens_is_reasoning_and_the_rest_content(deltas: list[str]) -> None:
    for syntax in (QWEN3, R1):
        assert split(syntax, deltas) == ("\nI weigh it", "\n\nYes.")


def test_cjk_and_emoji_beside_the_markers_stay_whole() -> None:
    deltas = ["<think>", "日本語🚀", "</think>", "答え😀"]
    assert split(QWEN3, deltas) == ("日本語🚀", "答え😀")
    assert split(R1, ["日本語🚀</think>答え😀"]) == ("日本語🚀", "答え😀")


def test_output_without_markers_is_content_for_qwen3_and_reasoning_for_deepseek_r1() -> None:
    assert split(QWEN3, ["Just ", "an answer."]) == (None, "Just an answer.")
    assert split(R1, ["Just ", "a thought."]) == ("Just a thought.", None)


def test_only_an_end_marker() -> None:
    """deepseek_r1 (vLLM's rule): reasoning up to </think>. qwen3: a thought only where <think> or the prompt opened
    one, so a stray </think> in an answer stays content."""
    assert split(R1, ["I weigh it", "</think>", "Yes."]) == ("I weigh it", "Yes.")
    assert split(QWEN3, ["I weigh it", "</think>", "Yes."]) == (None, "I weigh it</think>Yes.")
    opened = PLAIN_PROMPT + "<think>\n"  # a template that opens the thought in the prompt (Qwen3 thinking 2507)
    assert split(QWEN3, ["I weigh it", "</think>", "Yes."], opened) == ("I weigh it", "Yes.")


def test_an_unclosed_thought_is_all_reasoning() -> None:
    assert split(QWEN3, ["<think>", "still weigh", "ing"]) == ("still weighing", None)
    assert split(R1, ["still weigh", "ing"]) == ("still weighing", None)
    assert split(QWEN3, ["<think>"]) == ("", None)  # cut right after the marker: an empty thought, no content


def test_a_prompt_that_closed_the_thought_makes_the_output_all_content() -> None:
    """Qwen 3's enable_thinking false: the template writes an empty thought; markers the output writes stay."""
    closed = PLAIN_PROMPT + "<think>\n\n</think>\n\n"
    for syntax in (QWEN3, R1):
        assert first_phase(syntax, closed) is Phase.ANSWER
        assert split(syntax, ["Yes", "."], closed) == (None, "Yes.")


def test_only_the_first_thought_counts() -> None:
    assert split(QWEN3, ["<think>a</think>b<think>c</think>d"]) == ("a", "b<think>c</think>d")


def test_reasoning_tokens_count_the_thought_and_its_markers() -> None:
    tokenizer = build_qwen3_tokenizer()
    ids = marker_token_ids(tokenizer, QWEN3)
    assert set(ids) == {"<think>", "</think>"}
    text = "<think>\nweigh</think>\n\nYes."
    token_ids = tokenizer.encode(text)
    end = token_ids.index(ids["</think>"])
    whole = ReasoningSplitter(QWEN3, Phase.BEFORE, ids["</think>"])
    assert split_whole(whole, text, token_ids) == ("\nweigh", "\n\nYes.")
    assert whole.num_reasoning_tokens == end + 1
    streamed = ReasoningSplitter(QWEN3, Phase.BEFORE, ids["</think>"])
    for token_id in token_ids:
        streamed.feed(tokenizer.decode([token_id]), [token_id])
    assert streamed.num_reasoning_tokens == end + 1
    # A marker spelt in several tokens: counted by the tokens' text, through the one that completes it.
    plain = build_tokenizer()
    token_ids = plain.encode(text)
    by_text = ReasoningSplitter(QWEN3, Phase.BEFORE, None, lambda t: plain.decode([t]))
    assert split_whole(by_text, text, token_ids) == ("\nweigh", "\n\nYes.")
    assert plain.decode(token_ids[: by_text.num_reasoning_tokens]).endswith("</think>")
    assert not plain.decode(token_ids[: by_text.num_reasoning_tokens - 1]).endswith("</think>")


@pytest.mark.parametrize("text", [
    "<think>考え🚀 a</think>答え😀 b",
    "日本<think>x</think>y",
    "<think>\nlong thought with </thin and </ and <thi inside</think>\n\ncontent </thi",
])  # fmt: skip
def test_the_detokenizer_holds_a_partial_marker_back_until_it_is_whole(text: str) -> None:
    """Markers spelt in several tokens (the plain tiny tokenizer): no delta ends inside one, so the splitter never
    lets a piece of a marker into content or reasoning; the text as a whole is unchanged."""
    tokenizer = build_tokenizer()
    prompt = tokenizer.encode(PLAIN_PROMPT)
    token_ids = tokenizer.encode(text)
    assert tokenizer.decode(token_ids) == text
    assert all(len(tokenizer.encode(m, add_special_tokens=False)) > 1 for m in QWEN3.markers)
    detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, prompt, [], False, True, QWEN3.markers)
    deltas = [detokenizer.step(t)[0] for t in token_ids] + [detokenizer.flush(is_cut=False)]
    assert "".join(deltas) == text
    for delta in deltas[:-1]:  # the flush at the end releases what is held: the output's own last characters
        for marker in QWEN3.markers:
            assert not any(delta.endswith(marker[:k]) for k in range(1, len(marker))), (delta, deltas)
    reasoning, _ = split(QWEN3, deltas)  # streamed as the whole output splits
    assert reasoning is None or ("<think>" not in reasoning and "</think>" not in reasoning)


def test_markers_held_back_never_stop_the_output_and_stop_strings_still_do() -> None:
    tokenizer = build_tokenizer()
    token_ids = tokenizer.encode("<think>ab</think>cd")
    detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, [], ["c"], False, True, QWEN3.markers)
    text = ""
    for token_id in token_ids:
        delta, stop = detokenizer.step(token_id)
        text += delta
        if stop is not None:
            break
    assert (text, stop) == ("<think>ab</think>", "c")


@pytest.mark.parametrize("stop", [">>>", "k> ", "nk>\n"])
def test_a_stop_string_that_may_begin_in_a_markers_tail_does_not_split_the_marker(stop: str) -> None:
    """A stop string that may begin with a marker's last characters (">>>" after "</think>" held its ">") holds
    the whole marker back, not its tail: "</think" and ">The" in two deltas hid the thought's end from the splitter,
    and the answer was streamed as reasoning."""
    tokenizer = build_tokenizer()
    text = "<think>I weigh it</think>The answer is yes"
    detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, tokenizer.encode(PLAIN_PROMPT), [stop], False,
                                         True, QWEN3.markers)  # fmt: skip
    deltas = [detokenizer.step(t)[0] for t in tokenizer.encode(text)] + [detokenizer.flush(is_cut=False)]
    assert "".join(deltas) == text
    assert any("</think>" in delta for delta in deltas), deltas
    assert split(QWEN3, deltas) == ("I weigh it", "The answer is yes")


def test_the_config_names_the_parsers_and_the_tokenizer_must_hold_the_markers() -> None:
    assert EngineConfig().reasoning_parser == "" and reasoning_syntax("") is None
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1"):
        EngineConfig(reasoning_parser="qwen")
    special = build_tokenizer()
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    with pytest.raises(ValueError, match="does not give '<think>' back as text"):
        marker_token_ids(special, QWEN3)
    assert marker_token_ids(build_tokenizer(), QWEN3) == {}  # as text only: fine, spelt in several tokens


def test_the_start_fails_in_one_line_when_the_markers_are_not_text_of_the_model(tmp_path) -> None:
    special = build_tokenizer()
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    model_dir = save_tiny_llama(tmp_path / "special", tokenizer=special)
    with pytest.raises(ValueError, match="reasoning_parser qwen3: the tokenizer does not give '<think>' back as text"):
        LLM(str(model_dir), dtype="float32", num_threads=1, num_kv_blocks=64, reasoning_parser="qwen3")
    llm = LLM(str(model_dir), dtype="float32", num_threads=1, num_kv_blocks=64)  # off: no look at the markers
    assert llm.engine.reasoning_syntax is None


def test_deepseek_r1s_thought_from_the_start_is_a_chat_templates_and_a_plain_prompt_opens_none() -> None:
    assert first_phase(R1, PLAIN_PROMPT) is Phase.OPENING
    assert first_phase(R1, "Answer in JSON:", is_chat=False) is Phase.BEFORE  # a thought only if the output opens one
    assert first_phase(R1, "Answer in JSON: <think>\n", is_chat=False) is Phase.OPENING
    assert first_phase(QWEN3, PLAIN_PROMPT) is first_phase(QWEN3, PLAIN_PROMPT, is_chat=False) is Phase.BEFORE
