import codecs

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer

from tests.support.tiny_models import build_tokenizer

TEXTS = ["日本語のテキスト", "Emoji: 😀 🚀 👍🏽 ❤️!", "café naïve Zürich", "中文文本和한국어 텍스트.", "plain ascii words"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def stream(tokenizer, text, stop=(), include=False, prompt="Hello"):
    prompt_ids = tokenizer.encode(prompt)
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, prompt_ids, list(stop), include, True)
    deltas, matched = [], None
    for token_id in tokenizer.encode(text):
        delta, matched = detok.step(token_id)
        deltas.append(delta)
        if matched:
            break
    if not matched:
        deltas.append(detok.flush())
    return deltas, matched, detok


def test_a_prompt_ending_in_a_cut_or_replaced_character_stays_out_of_the_output(tokenizer):
    cjk = tokenizer.encode("日本の首都は")
    cut = next(cjk[:k] for k in range(1, len(cjk)) if tokenizer.decode(cjk[:k]).endswith("\ufffd"))
    prompts = [tokenizer.encode(text) for text in ("Broken text caf\ufffd", "\ufffd", "ok \ufffd" * 9)] + [cut]
    for prompt_ids in prompts:
        detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, prompt_ids, [], False, True)
        deltas = [detok.step(token_id)[0] for token_id in tokenizer.encode(" is a cafe")] + [detok.flush()]
        # the cut character's first bytes, which " is" does not finish, are an invalid character of the output
        expected = "\ufffd is a cafe" if prompt_ids is cut else " is a cafe"
        assert "".join(deltas) == expected == detok.text, tokenizer.decode(prompt_ids)


def test_an_output_that_finishes_a_character_the_prompt_cut_has_that_character(tokenizer):
    ids = tokenizer.encode("Der Hauptstadt 日本の首都は東京です")
    full = tokenizer.decode(ids)
    num_cut = 0
    for k in range(1, len(ids)):
        prompt_text = tokenizer.decode(ids[:k])
        num_cut += prompt_text.endswith("\ufffd")
        detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, ids[:k], [], False, True)
        deltas = [detok.step(token_id)[0] for token_id in ids[k:]] + [detok.flush()]
        assert "".join(deltas) == full[len(prompt_text.rstrip("\ufffd")) :], k
    assert num_cut > 5  # the tiny BPE splits these characters across tokens


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_whole_characters_and_concatenate_to_the_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # the tiny BPE splits these characters across tokens
    deltas, _, detok = stream(tokenizer, text)
    assert all("\ufffd" not in d for d in deltas)
    for d in deltas:
        d.encode("utf-8")  # no lone surrogates
    assert "".join(deltas) == text == detok.text


def test_a_split_character_is_held_until_complete(tokenizer):
    assert len(tokenizer.encode("😀")) > 1
    deltas, _, _ = stream(tokenizer, "😀")
    assert all(d in ("", "😀") for d in deltas) and "".join(deltas) == "😀"


@pytest.mark.parametrize("stop", ["brown fox", "x j", "日本", "🚀"])
def test_stop_string_spanning_tokens_never_leaks(tokenizer, stop):
    text = "The quick brown fox jumps 日本語 🚀 done"
    text = text if stop in text else text + stop
    deltas, matched, detok = stream(tokenizer, text + " tail", stop=[stop])
    assert matched == stop
    assert "".join(deltas) == text[: text.index(stop)]
    for i in range(len(deltas)):
        assert stop not in "".join(deltas[: i + 1])


def test_include_stop_str_in_output(tokenizer):
    deltas, matched, _ = stream(tokenizer, "say hello world now", stop=["world"], include=True)
    assert matched == "world" and "".join(deltas) == "say hello world"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, matched, _ = stream(tokenizer, "one two three", stop=["three", "two"])
    assert matched == "two" and "".join(deltas) == "one "


def test_partial_stop_match_is_released_when_it_cannot_match(tokenizer):
    deltas, matched, _ = stream(tokenizer, "the fox jumps", stop=["fox!"])
    assert matched is None and "".join(deltas) == "the fox jumps"


def test_a_character_cut_off_at_the_end_is_dropped(tokenizer):
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, [], [], False, True)
    assert detok.step(tokenizer.encode("o")[0]) == ("o", None)
    first_byte_of_emoji = tokenizer.encode("😀")[0]
    assert detok.step(first_byte_of_emoji) == ("", None)
    assert detok.flush() == "" and detok.text == "o"


@pytest.mark.parametrize(
    "data",
    [b"\xed\xef\x97\xed\xef\x97", b"\x80\x80", b"\xc3\xc3", b"\xf0\x9f\x98", b"ok\xe6\x80\xe6", b"\xff\xe6\x97\xa5\xe6"],
)
def test_bytes_that_make_no_character_are_replaced_at_the_end(tokenizer, data):
    """A random model's bytes may never make a character: the stream holds them all. At the end they show as in
    a full decode (U+FFFD), less only the character the length cut (not a whole output lost)."""
    byte_token = {b: tokenizer.convert_tokens_to_ids(c) for c, b in _alphabet().items()}
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, tokenizer.encode("Hello"), [], False, True)
    deltas = [detok.step(byte_token[b])[0] for b in data] + [detok.flush()]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    expected = decoder.decode(data)  # without final=True: a cut character's bytes stay in the decoder
    assert "".join(deltas) == expected == detok.text  # "" only for the cut emoji alone


def test_a_special_token_among_held_bytes_is_skipped(tokenizer):
    byte_token = {b: tokenizer.convert_tokens_to_ids(c) for c, b in _alphabet().items()}
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, tokenizer.encode("Hello"), [], False, True)
    assert [detok.step(t)[0] for t in (byte_token[0x80], special, byte_token[0xE6])] == ["", "", ""]
    assert detok.flush() == "\ufffd"  # the stray byte; the special token skipped, the cut character dropped


def test_a_last_character_is_dropped_only_when_the_length_cut_it(tokenizer):
    """EOS, a stop token or a grammar that ends the output leave its last bytes what they are: no character."""
    byte_token = {b: tokenizer.convert_tokens_to_ids(c) for c, b in _alphabet().items()}
    for is_cut, expected in ((True, ""), (False, "\ufffd")):
        detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, tokenizer.encode("Hello"), [], False, True)
        assert detok.step(byte_token[0xE6]) == ("", None)
        assert detok.flush(is_cut=is_cut) == expected == detok.text


@pytest.mark.parametrize(("include", "expected"), [(False, "ok "), (True, "ok \ufffd")])
def test_a_stop_string_in_the_released_bytes_ends_the_text_there(tokenizer, include, expected):
    byte_token = {b: tokenizer.convert_tokens_to_ids(c) for c, b in _alphabet().items()}
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, tokenizer.encode("Hello"), ["\ufffd"], include, True)
    deltas = [detok.step(t)[0] for t in tokenizer.encode("ok ")]
    delta, matched = detok.step(byte_token[0x80])  # a stray byte: U+FFFD at once, whatever follows
    assert matched == "\ufffd" and "".join([*deltas, delta]) == expected == detok.text


def _alphabet() -> dict[str, int]:
    from engine.token_bytes import _byte_level_alphabet

    return _byte_level_alphabet()


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """The definition, spelt out: every suffix length against every stop string."""
    return max(
        (n for stop in stops for n in range(1, min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:n])),
        default=0,
    )


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab日😀 ", max_size=40),
    stops=st.lists(st.text(alphabet="ab日😀 ", min_size=1, max_size=12), min_size=1, max_size=4),
)
def test_held_back_tail_is_the_longest_possible_stop_start(text, stops):
    detok = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
    assert detok._num_possible_stop_start(text, tuple(stops)) == _longest_stop_prefix_suffix(text, stops)


def test_a_stop_string_a_literal_replacement_character_completes_ends_the_output_at_once(tokenizer):
    """The stream holds a token whose text ends in U+FFFD (it may be a character's first bytes); a real one, whole,
    that completes a stop string ends the output at that token, not after the next character."""
    byte_token = {b: tokenizer.convert_tokens_to_ids(c) for c, b in _alphabet().items()}
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, tokenizer.encode("Hello"), ["\ufffd"], False, True)
    assert [detok.step(byte_token[b]) for b in b"\xef\xbf"] == [("", None), ("", None)]
    assert detok.step(byte_token[0xBD]) == ("", "\ufffd") and detok.text == ""


@pytest.fixture(scope="module")
def gemma_tokenizer():
    from engine.checkpoint.source import open_checkpoint
    from engine.config import EngineConfig
    from engine.models.packaged import gemma3_270m_gguf

    config = EngineConfig()
    return open_checkpoint(str(gemma3_270m_gguf(config.cache_path)), config.cache_path).tokenizer()


def test_a_cut_character_after_a_literal_replacement_piece_is_dropped(gemma_tokenizer):
    """Gemma 3 spells U+FFFD as a piece of its own (not byte tokens): a character max_tokens cut after it was
    released as one U+FFFD per byte; stop strings found it one character late."""
    ids = gemma_tokenizer.encode("𠀀\ufffd𠀀\ufffd", add_special_tokens=False)  # 4 bytes, "�", 4 bytes, "�"
    assert gemma_tokenizer.convert_ids_to_tokens(ids[4]) == "\ufffd" and len(ids) == 10
    backend, prompt = gemma_tokenizer.backend_tokenizer, gemma_tokenizer.encode("Hi")
    for n, expected in ((5, "𠀀\ufffd"), (6, "𠀀\ufffd"), (8, "𠀀\ufffd"), (9, "𠀀\ufffd𠀀"), (10, "𠀀\ufffd𠀀\ufffd")):
        detok = IncrementalDetokenizer(backend, prompt, [], False, True)
        assert "".join(detok.step(t)[0] for t in ids[:n]) + detok.flush(is_cut=True) == expected, n
    detok = IncrementalDetokenizer(backend, prompt, ["\ufffd"], False, True)
    assert [detok.step(t) for t in ids[:5]] == [("", None)] * 3 + [("𠀀", None), ("", "\ufffd")]
