"""Tokens out: each sampled token becomes a delta (detokenized, stop strings held back) and maybe a finish.

It decides, and the engine applies: the OutputProcessor never touches the scheduler or the blocks.
"""

from __future__ import annotations

import time

from engine.batch import SampledToken
from engine.grammar_compiler import matcher_error
from engine.outputs import FinishReason, RequestOutput
from engine.sequence import Sequence


class OutputProcessor:
    def __init__(
        self, eos_token_ids: frozenset[int], max_model_len: int, primary_eos_token_id: int | None = None
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # The tokenizer's own EOS ends an output with stop_reason None; the others (an end-of-turn token, the
        # generation config's further ids) are named as stop token ids are, as vLLM names them.
        self.primary_eos_token_id = primary_eos_token_id

    def on_token(self, seq: Sequence, token: SampledToken) -> RequestOutput:
        """Append one sampled token to seq and return its delta; finish_reason is set when it ends seq."""
        token_id = token.token_id
        seq.output_token_ids.append(token_id)
        if seq.logprobs is not None:
            seq.logprobs.append(token)
        params = seq.params
        can_stop = seq.num_output_tokens >= params.min_tokens
        is_eos = can_stop and not params.ignore_eos and token_id in self.eos_token_ids
        is_stop_token = can_stop and token_id in seq.stop_token_ids
        if (is_eos or is_stop_token) and not params.include_stop_str_in_output:
            text, stop_str = "", None  # the token that ends the output is not its text (as a stop string is not)
        else:
            text, stop_str = seq.detokenizer.step(token_id, can_stop)
        is_grammar_done = seq.matcher is not None and _advance_grammar(seq, token_id)
        reason: FinishReason | None = None
        stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        if stop_str is not None:
            reason, stop_reason = FinishReason.STOP, stop_str
        elif is_eos:
            reason = FinishReason.STOP
            stop_reason = None if token_id == self.primary_eos_token_id else token_id
        elif is_stop_token:
            reason, stop_reason = FinishReason.STOP, token_id
        elif is_grammar_done:  # the output is complete: nothing but EOS could follow
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        out = self._output(seq, [token_id], text)
        if seq.logprobs is not None:
            out.logprobs = [token]
        if seq.prompt_logprobs is not None and seq.num_output_tokens == 1:
            out.prompt_logprobs = seq.prompt_logprobs
        if reason is not None:
            if stop_str is None:
                out.text_delta += seq.detokenizer.flush(is_cut=reason is FinishReason.LENGTH)
            out.finished, out.finish_reason, out.stop_reason = True, reason, stop_reason
        return out

    def final(self, seq: Sequence, reason: FinishReason, error: str | None = None,
              error_code: str | None = None) -> list[RequestOutput]:  # fmt: skip
        """The last delta of each choice seq stands for (a fork parent: all n), ended from outside its tokens
        (abort, error)."""
        outs = []
        for index in range(seq.num_forks) if seq.num_forks else [seq.index]:
            out = self._output(seq, [], "")
            out.index, out.finished, out.finish_reason, out.error = index, True, reason, error
            out.error_code = error_code
            outs.append(out)
        return outs

    @staticmethod
    def _output(seq: Sequence, token_ids: list[int], text: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=token_ids,
            text_delta=text,
            num_prompt_tokens=len(seq.request.prompt_token_ids),  # a fork parent computes a part of it
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            index=seq.index,
        )


STRUCTURED_OUTPUT_FAILED = "structured_output_failed"  # the error code of a GrammarViolation: the client's 400


class GrammarViolation(RuntimeError):
    """The matcher refused a sampled token: a mask that was not applied (a bug), or a grammar that outgrew
    llguidance's limits mid-output; or the grammar cost the batch more than its bound (engine/grammar_clock.py).
    Either way it fails that request alone."""


def _advance_grammar(seq: Sequence, token_id: int) -> bool:
    """Feed a sampled token to the sequence's matcher; True once the grammar accepts no further token."""
    matcher = seq.matcher
    start = time.thread_time()
    if not matcher.consume_token(token_id):
        raise GrammarViolation(f"token {token_id} breaks the grammar: {matcher_error(matcher)}")
    overrun = seq.grammar_clock.on_token(time.thread_time() - start)
    if overrun is not None:
        raise GrammarViolation(overrun)
    return matcher.is_stopped()
