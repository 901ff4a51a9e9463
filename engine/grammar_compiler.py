"""StructuredOutputs -> an llguidance matcher: compiled once per request, in the input processor.

The llguidance tokenizer (built from the Hugging Face one, about 0.7 s for a 49k vocabulary) is made on the
first constrained request, so that servers that never see one never pay for it.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from engine.errors import InvalidRequest
from engine.reasoning_parser import Phase
from engine.structured_outputs import StructuredOutputs
from engine.thought_grammar import ThoughtMarkers, after_thought

# JSON is written as json.dumps writes it ({"a": 1, "b": [2, 3]}): small models given free whitespace tend to
# fill the output with it. A schema's own "x-guidance" options override these.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The Earley items one row of a parse may hold (llguidance's default: 2000). A wide constraint needs many at once:
# a choice's first row holds an item per entry, a flat schema ~4 per property (400 optional enum properties: 1,599;
# 2,800, the most the 100,000-character limit takes: 11,199, at 8-23 ms a token). An ambiguous grammar's rows grow
# with its output, and every token's step walks them while the batch waits: the time is what bounds that
# (engine/grammar_clock.py ends it after 0.25 s at over 5 ms a token), this cap only the memory.
MAX_ROW_ITEMS = 20_000

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer
    from transformers import PreTrainedTokenizerBase


def build_ll_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: list[int]) -> LLTokenizer:
    """llguidance's view of the vocabulary. It holds the GIL while it builds (1.8-2.5 s for Gemma 3's 262k tokens,
    0.3 s for 49k): the caller keeps it off the event loop's turn (input_slot.with_grammar)."""
    import llguidance.hf

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)
    # what from_tokenizer does, without its copy of the tokenizer (a pickle round trip, 1.4 s for 262k tokens) made
    # only to turn off padding and truncation, which are off
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids)


class GrammarCompiler:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """vocab_size: the sampler's vocabulary (its logits' width): one mask bit per token."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        # The grammar allows these only where the output may end, and only these once it must.
        self.eos_token_ids = sorted(eos_token_ids) or [tokenizer.eos_token_id]
        self._ll_tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def has_tokenizer(self) -> bool:
        return self._ll_tokenizer is not None

    @property
    def ll_tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = build_ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._ll_tokenizer

    def compile(
        self, structured: StructuredOutputs, markers: ThoughtMarkers | None = None, phase: Phase = Phase.ANSWER
    ) -> LLMatcher:
        """A fresh matcher at the start of the output; InvalidRequest naming the parameter if it does not compile.
        markers (a reasoning parser's) and phase (where the output starts): the grammar starts after the thought."""
        from llguidance import LLMatcher, LLParserLimits

        param = structured.error_param()
        try:
            grammar = self.grammar_text(structured)
        except ValueError as error:  # a schema that is not a JSON object
            raise InvalidRequest(f"{param}: {_first_lines(error)}", param) from None
        # verbose_errors off: an error's words go to the client, and llguidance's verbose ones dump its parser state
        limits = LLParserLimits(max_items_in_row=MAX_ROW_ITEMS, verbose_errors=False)
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise InvalidRequest(f"{param} cannot be compiled: {_first_lines(matcher_error(matcher))}", param)
        # A schema no JSON value satisfies (one that only refers to itself) compiles to a grammar of the empty
        # output, which no JSON text is: an answer of "" with finish_reason "stop" otherwise.
        if structured.json is not None and self._allows_only_eos(matcher):
            raise InvalidRequest(f"{param} is an unsatisfiable schema: no JSON value matches it", param)
        if markers is None or phase is Phase.ANSWER or (structured.grammar is not None and markers.names_end(grammar)):
            return matcher
        # the request's grammar compiled alone above: its errors and checks are the same with a parser or without
        matcher = LLMatcher(self.ll_tokenizer, after_thought(grammar, markers, phase), log_level=0, limits=limits)
        if matcher.is_error():
            raise InvalidRequest(f"{param} cannot be compiled after a thought: {_first_lines(matcher_error(matcher))}",
                                 param)  # fmt: skip
        return matcher

    def _allows_only_eos(self, matcher: LLMatcher) -> bool:
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        bits[self.eos_token_ids] = 0
        return not bits.any()

    @staticmethod
    def grammar_text(structured: StructuredOutputs) -> str:
        from llguidance import LLMatcher

        if structured.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_FORMAT)
        if structured.json is not None:
            schema = structured.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
        if structured.regex is not None:
            return LLMatcher.grammar_from_regex(structured.regex)
        if structured.choice is not None:
            # JSON string literals are Lark string literals: every choice is matched exactly, quotes and all.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in structured.choice))
        assert structured.grammar is not None
        return LLMatcher.grammar_from_lark(structured.grammar)


_ROW_LIMIT = re.compile(r"Current row has (\d+) items; max is (\d+).*", re.DOTALL)
# A regex that compiles lazily (a{1000000000}) outgrows the lexer's limit only once the output reaches it.
_LEXER_LIMIT = re.compile(r"lexer error: too many expressions constructed.*", re.DOTALL)


def matcher_error(matcher: LLMatcher) -> str:
    """The matcher's error in words for the client (without llguidance's marker of a non-verbose error, and
    without its advice to grammar writers where the constraint outgrew the parse's row limit)."""
    error = matcher.get_error().replace("<non-verbose/>", "").strip()
    error = _LEXER_LIMIT.sub("its regular expressions grew past llguidance's limit (a repetition count too large "
                             "to follow)", error)  # fmt: skip
    return _ROW_LIMIT.sub(r"its parse needs \1 items at once, more than the \2 allowed (a constraint too wide or "
                          r"too ambiguous to follow)", error)  # fmt: skip


def _first_lines(error: object, limit: int = 400) -> str:
    text = str(error).strip()
    return text[:limit]
