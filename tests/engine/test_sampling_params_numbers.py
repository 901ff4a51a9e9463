"""SamplingParams takes numpy's scalars as the numbers they are (a seed from np.random, a max_tokens computed with
numpy), as the prompt's token ids are taken, and keeps them as Python's own int and float."""

import numpy as np
import pytest

from engine import SamplingParams


def test_numpy_scalars_are_taken_as_python_numbers():
    params = SamplingParams(
        max_tokens=np.int64(8), min_tokens=np.int32(1), top_k=np.int64(5), seed=np.int64(7), n=np.int32(2),
        logprobs=np.int64(2), temperature=np.float32(0.5), top_p=np.float64(0.9), min_p=np.float16(0.0),
        presence_penalty=np.float32(0.5), frequency_penalty=np.int64(1), repetition_penalty=np.float32(1.1),
        stop_token_ids=[np.int64(2)], logit_bias={np.int64(5): np.float32(-1.5)},
    )  # fmt: skip
    for name in ("max_tokens", "min_tokens", "top_k", "seed", "n", "logprobs"):
        assert type(getattr(params, name)) is int, name
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"):
        assert type(getattr(params, name)) is float, name
    assert (params.max_tokens, params.seed, params.temperature) == (8, 7, 0.5)
    assert params.stop_token_ids == [2] and type(params.stop_token_ids[0]) is int
    assert params.logit_bias == {5: -1.5} and type(next(iter(params.logit_bias))) is int


@pytest.mark.parametrize("kwargs", [{"max_tokens": np.int64(0)}, {"seed": np.uint64(2**64 - 1)},
                                    {"temperature": np.float32("nan")}, {"ignore_eos": np.int64(1)},
                                    {"max_tokens": np.bool_(True)}, {"top_p": np.float64(1.5)}])  # fmt: skip
def test_numpy_scalars_out_of_range_are_still_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
