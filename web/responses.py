"""The bodies and stream chunks of /v1/chat/completions and /v1/completions, built from engine deltas."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from engine.batch import SampledToken
from engine.outputs import ChoiceOutput, FinishReason, RequestOutput
from engine.reasoning_parser import ReasoningSplitter, split_whole
from engine.request import Request
from web.logprobs import TextOffsets, TokenText, chat_logprobs, completion_logprobs
from web.tool_calls import ArgumentsPiece, ToolCallHeader, ToolCallParser
from web.tool_calls.parser import CallSyntax, ParserEvent


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int | None = None  # with a reasoning parser: the completion's tokens inside the thought

    @classmethod
    def of_choices(cls, choices: list[ChoiceOutput]) -> Usage:
        """One request's usage: its prompt counted once (the n choices share it), the choices' tokens summed."""
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return cls(choices[0].num_prompt_tokens, completion_tokens, max(c.num_cached_tokens for c in choices))

    @classmethod
    def of_request(cls, request: Request) -> Usage:
        """The same, for a streamed request, from what its choices' deltas said."""
        return cls(request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens)

    @classmethod
    def of_output(cls, output: RequestOutput) -> Usage:
        """One choice's usage as of this delta (vLLM's continuous_usage_stats count per choice)."""
        return cls(output.num_prompt_tokens, output.num_output_tokens, output.num_cached_tokens)

    @classmethod
    def total(cls, usages: list[Usage]) -> Usage:
        """A list of prompts' usage: every prompt's tokens counted."""
        return cls(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                   sum(u.cached_tokens for u in usages))  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.reasoning_tokens is not None:  # OpenAI's field (vLLM has none)
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage


@dataclass(frozen=True, slots=True)
class EchoedPrompt:
    """What `echo` puts before a completion: the prompt as text, and its token ids (the first `num_unseen_before`
    and the last `num_unseen_after` of them are not in the text: the special tokens the tokenizer added to it)."""

    text: str
    token_ids: list[int]
    num_unseen_before: int = 0
    num_unseen_after: int = 0

    def unseen(self) -> set[int]:
        n = len(self.token_ids)
        return set(range(self.num_unseen_before)) | set(range(n - self.num_unseen_after, n))


class _Responses:
    id_prefix = ""
    chunk_object = ""
    response_object = ""

    def __init__(
        self, model: str, token_text: TokenText, wants_logprobs: bool, include_usage: bool,
        continuous_usage: bool = False,
    ) -> None:  # fmt: skip
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.token_text = token_text
        self.wants_logprobs = wants_logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self._usage_now: dict[str, Any] | None = None  # what each chunk's usage says (None but with continuous_usage)

    def usage_now(self, usage: Usage) -> None:
        """With continuous_usage: the usage the chunks built next carry."""
        self._usage_now = usage.as_dict()

    def _envelope(self, object_name: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object, [choice])
        if self.include_usage:
            chunk["usage"] = self._usage_now
        return chunk

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": usage.as_dict()}

    def _response(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        return {**self._envelope(self.response_object, choices), "usage": usage.as_dict()}


class ChatResponses(_Responses):
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tool_syntax: CallSyntax | None = None  # set when the output may hold tool calls
        self._tool_parsers: dict[int, ToolCallParser] = {}  # per choice index
        self._new_splitter: Callable[[], ReasoningSplitter] | None = None  # set with a reasoning parser
        self._splitters: dict[int, ReasoningSplitter] = {}  # per choice index

    def read_tool_calls(self, syntax: CallSyntax) -> None:
        self._tool_syntax = syntax

    def read_reasoning(self, new_splitter: Callable[[], ReasoningSplitter] | None) -> None:
        """Split each choice's thought from its answer (reasoning_content and reasoning, then content)."""
        self._new_splitter = new_splitter

    def _splitter(self, index: int) -> ReasoningSplitter | None:
        if self._new_splitter is None:
            return None
        splitter = self._splitters.get(index)
        if splitter is None:
            splitter = self._splitters[index] = self._new_splitter()
        return splitter

    def _parser(self, index: int) -> ToolCallParser | None:
        if self._tool_syntax is None:
            return None
        parser = self._tool_parsers.get(index)
        if parser is None:
            parser = self._tool_parsers[index] = ToolCallParser(self._tool_syntax)
        return parser

    def _delta(
        self, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None, index: int = 0
    ) -> dict:
        return self._chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

    def opening_chunks(self, num_choices: int = 1) -> list[dict]:
        # Where calls may come, content null, as OpenAI opens a message of calls (whole, its content is null too);
        # text that follows arrives in content deltas as ever.
        content = None if self._tool_syntax is not None else ""
        return [self._delta({"role": "assistant", "content": content}, index=i) for i in range(num_choices)]

    def delta_chunks(self, output: RequestOutput) -> list[dict]:
        logprobs = chat_logprobs(output.logprobs, self.token_text) if self.wants_logprobs and output.logprobs else None
        text = output.text_delta
        if self._new_splitter is not None:  # a reasoning parser (off: nothing more per delta than this look)
            return self._split_delta_chunks(output, self._splitter(output.index), logprobs)  # type: ignore[arg-type]
        parser = self._parser(output.index)
        if parser is None:
            if not text and logprobs is None:
                return []
            return [self._delta({"content": text}, logprobs=logprobs, index=output.index)]
        return self._chunks(_event_deltas(self._tool_events(parser, text, output.finished)), logprobs, output.index)

    def _split_delta_chunks(self, output: RequestOutput, splitter: ReasoningSplitter, logprobs: Any) -> list[dict]:
        """The thought's text as reasoning_content (and vLLM 0.18's name, reasoning), the rest as content or
        tool calls: markers in neither."""
        reasoning, text = splitter.feed(output.text_delta, output.new_token_ids)
        if output.finished:
            more_reasoning, more_text = splitter.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
        parser = self._parser(output.index)
        if parser is None:
            deltas = [{"content": text}] if text else []
        else:
            deltas = _event_deltas(self._tool_events(parser, text, output.finished))
        if reasoning:
            if deltas and "content" in deltas[0]:
                deltas[0] = {"reasoning_content": reasoning, "reasoning": reasoning, **deltas[0]}
            else:
                deltas.insert(0, {"reasoning_content": reasoning, "reasoning": reasoning})
        if logprobs is not None and not deltas:  # the tokens' logprobs go out even where their text is a marker
            deltas = [{"reasoning_content": "", "reasoning": ""} if splitter.is_in_thought else {"content": ""}]
        return self._chunks(deltas, logprobs, output.index)

    @staticmethod
    def _tool_events(parser: ToolCallParser, text: str, is_finished: bool) -> list[ParserEvent]:
        events = parser.feed(text)
        if is_finished:
            events += parser.finish()
        return events

    def _chunks(self, deltas: list[dict[str, Any]], logprobs: Any, index: int) -> list[dict]:
        return [self._delta(d, logprobs=logprobs if i == 0 else None, index=index) for i, d in enumerate(deltas)]

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return super().usage_chunk(self._with_reasoning_tokens(usage))

    def _with_reasoning_tokens(self, usage: Usage) -> Usage:
        """usage with its reasoning_tokens counted by the choices' splitters (with a reasoning parser)."""
        if self._new_splitter is not None:
            usage.reasoning_tokens = sum(s.num_reasoning_tokens for s in self._splitters.values())
        return usage

    def finish_chunk(self, finish_reason: FinishReason, index: int = 0, stop_reason: str | int | None = None) -> dict:
        chunk = self._delta({}, self._finish_reason(finish_reason, self._parser(index)), index=index)
        chunk["choices"][0]["stop_reason"] = stop_reason
        return chunk

    @staticmethod
    def _finish_reason(finish_reason: FinishReason | None, parser: ToolCallParser | None) -> FinishReason | None:
        """"tool_calls" for an output that ended after whole calls; a call a stop string cut in its arguments keeps
        "stop", as one max_tokens cut keeps "length" (a client would run a call whose arguments are not JSON)."""
        if finish_reason is not FinishReason.STOP or parser is None or not parser.calls:
            return finish_reason
        return FinishReason.TOOL_CALLS if all(_is_json(c.arguments) for c in parser.calls) else finish_reason

    def full_response(self, results: list[ChoiceOutput]) -> dict:
        """results: the request's choices, in index order."""
        choices = [self._choice(i, r) for i, r in enumerate(results)]  # first: each choice's splitter counts
        return self._response(choices, self._with_reasoning_tokens(Usage.of_choices(results)))

    def _choice(self, index: int, result: ChoiceOutput) -> dict[str, Any]:
        logprobs = chat_logprobs(result.logprobs or [], self.token_text) if self.wants_logprobs else None
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        text, splitter = result.text, self._splitter(index)
        if splitter is not None:  # reasoning_content as DeepSeek's API, SGLang and llama.cpp; reasoning as vLLM 0.18
            reasoning, content = split_whole(splitter, result.text, result.token_ids)
            message.update(content=content, reasoning_content=reasoning, reasoning=reasoning)
            text = content or ""
        parser = self._parser(index)
        if parser is not None:
            events = parser.feed(text) + parser.finish()
            content = "".join(e for e in events if isinstance(e, str))
            message["content"] = content or None
            if parser.calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in parser.calls
                ]
        finish_reason = self._finish_reason(result.finish_reason, parser)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": result.stop_reason}  # fmt: skip


def _is_json(text: str) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True


def _event_deltas(events: list[ParserEvent]) -> list[dict[str, Any]]:
    """Parser events as OpenAI deltas: content runs merged; a call's first delta carries its index, id, type and
    name (arguments ""), later ones argument pieces only."""
    deltas: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, str):
            if deltas and "content" in deltas[-1]:
                deltas[-1]["content"] += event
            else:
                deltas.append({"content": event})
        elif isinstance(event, ToolCallHeader):
            call = {"index": event.index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}  # fmt: skip
            deltas.append({"tool_calls": [call]})
        elif isinstance(event, ArgumentsPiece):
            deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
    return deltas


class CompletionResponses(_Responses):
    id_prefix = "cmpl"
    chunk_object = "text_completion"
    response_object = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, TextOffsets] = {}  # per choice index

    def _text(self, text: str, finish_reason: str | None = None, logprobs: Any = None, index: int = 0) -> dict:
        return self._chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})

    def opening_chunks(self, num_choices: int = 1) -> list[dict]:
        return []

    def delta_chunks(self, output: RequestOutput) -> list[dict]:
        logprobs = None
        if self.wants_logprobs and output.logprobs:
            offsets = self._offsets.setdefault(output.index, TextOffsets())
            logprobs = completion_logprobs(output.logprobs, self.token_text, offsets)
        if not output.text_delta and logprobs is None:
            return []
        return [self._text(output.text_delta, logprobs=logprobs, index=output.index)]

    def finish_chunk(self, finish_reason: FinishReason, index: int = 0, stop_reason: str | int | None = None) -> dict:
        chunk = self._text("", finish_reason, index=index)
        chunk["choices"][0]["stop_reason"] = stop_reason
        return chunk

    def full_response(self, results: list[ChoiceOutput]) -> dict:
        """results: the request's choices, in index order."""
        return self.batch_response([results])

    def batch_response(self, results: list[list[ChoiceOutput]], echoes: list[EchoedPrompt] | None = None) -> dict:
        """The n choices of each prompt, prompt by prompt (choice index = prompt * n + i, as OpenAI numbers
        them); with echoes, each text (and its logprobs) starts with its prompt."""
        choices = [
            self._choice(p * len(group) + i, r, echoes[p] if echoes else None)
            for p, group in enumerate(results)
            for i, r in enumerate(group)
        ]
        usage = Usage.total([Usage.of_choices(group) for group in results])
        return {**self._envelope(self.response_object, choices), "usage": usage.as_dict()}

    def _choice(self, index: int, result: ChoiceOutput, echo: EchoedPrompt | None) -> dict[str, Any]:
        text, tokens, unseen = result.text, result.logprobs or [], set[int]()
        if echo is not None:
            unseen = echo.unseen()
            text = echo.text + text
            scored = result.prompt_logprobs or [None] * len(echo.token_ids)
            # The first prompt token has no logprob (nothing comes before it): no top_logprobs either.
            tokens = [s or SampledToken(t) for t, s in zip(echo.token_ids, scored)] + tokens
        logprobs = completion_logprobs(tokens, self.token_text, TextOffsets(), unseen) if self.wants_logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason,
                "stop_reason": result.stop_reason}  # fmt: skip


ResponseFormat = ChatResponses | CompletionResponses
