"""Stop strings the engine can match: a lone surrogate can never be generated (every output is UTF-8 text), so it is
refused, as a prompt holding one is, rather than accepted and never matched."""

import pytest

from engine import SamplingParams


@pytest.mark.parametrize("stop", ["\ud800", ["fine", "a\udfffb"]])
def test_a_stop_string_that_is_not_unicode_text_is_refused(stop) -> None:
    with pytest.raises(ValueError, match="valid Unicode"):
        SamplingParams(stop=stop)


def test_cjk_and_emoji_stop_strings_are_taken() -> None:
    assert SamplingParams(stop=["。", "😀", "終わり"]).stop == ["。", "😀", "終わり"]
