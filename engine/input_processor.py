"""Requests in: chat template, tokenization and every check, once, producing a PreparedRequest.

Pure CPU work with no engine state, so the server runs it on its event loop or in a worker thread by the input's
size (engine/input_slot.py). Size limits that need no tokenizer are checked first: a prompt longer than
max_model_len tokens of the vocabulary's longest token cannot fit, so megabytes of text are rejected before
anyone tokenizes them.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import InvalidRequest
from engine.grammar_compiler import GrammarCompiler
from engine.reasoning_parser import Phase, ReasoningSyntax, first_phase
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputs
from engine.thought_grammar import PROMPT_TAIL_TOKENS, ThoughtMarkers

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for a request over the context

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request that passed every check: admission takes only these."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, or what the context leaves when that is None
    matcher: Any = None  # an llguidance LLMatcher when params.structured_outputs is set: the sequence owns it
    # Where the output starts (a reasoning parser's phase, read once from the prompt's last tokens): the reasoning
    # splitter and the grammar both begin there. ANSWER without a parser.
    first_phase: Phase = Phase.ANSWER


class InputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        max_num_seqs: int | None = None,
        longest_token_chars: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # One mask bit per token the sampler can choose: the model's vocabulary, less any padding past the tokenizer.
        self.grammar_compiler = GrammarCompiler(tokenizer, min(len(tokenizer), vocab_size), eos_token_ids)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.context_limit = "max_model_len"  # what sets max_model_len, as the errors name it
        self.max_num_seqs = max_num_seqs  # n choices run at once: a request's n must fit in one batch
        # Every token covers at most this many characters of text (its raw form is at least as long as the
        # text it encodes), so a longer prompt has more than max_model_len tokens. The vocabulary's strings, when
        # the checkpoint has not counted them (get_vocab: 0.2 s for a 262k vocabulary); added tokens either way.
        if longest_token_chars is None:
            longest_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)
        longest_token = max([longest_token_chars, *map(len, tokenizer.get_added_vocab())])
        self.max_prompt_chars = max_model_len * max(longest_token, 1)
        # A reasoning parser (engine/reasoning_parser.py) and, where the engine compiles grammars, its markers'
        # tokens (engine/thought_grammar.py): a grammar then starts after the thought.
        self.reasoning_syntax: ReasoningSyntax | None = None
        self.thought_markers: ThoughtMarkers | None = None

    # ---- prompts -------------------------------------------------------------------------------------
    def process_prompt(
        self, request_id: str, prompt: Prompt, params: SamplingParams, is_chat: bool = False
    ) -> PreparedRequest:
        """is_chat: the prompt is a chat template's rendering (LLM.chat's token ids), which may open a thought."""
        return self._prepare(request_id, self.encode_prompt(prompt), params, "prompt", is_chat)

    def process_chat(
        self, request_id: str, messages: Sequence[Mapping[str, Any]], params: SamplingParams, **template_kwargs: Any
    ) -> PreparedRequest:
        return self._prepare(request_id, self.encode_chat(messages, **template_kwargs), params, "messages", True)

    def encode_prompt(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):  # "" is a prompt on a model whose tokenizer adds a start token (as in vLLM)
            self._check_chars(len(prompt), "prompt")
            try:
                return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            except TypeError:  # the tokenizer takes no text that is not UTF-8: a lone surrogate, say
                raise InvalidRequest("prompt is not valid Unicode text (a lone surrogate?)", param="prompt") from None
        prompt = as_token_list(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequest("prompt must be a non-empty string or a non-empty list of token ids", param="prompt")
        self._check_num_tokens(len(prompt), "prompt")
        self._check_vocabulary(prompt, "prompt")
        return [int(t) for t in prompt]

    def decode(self, token_ids: list[int]) -> str:
        """Token ids back to text, special tokens included (what /detokenize and echo show)."""
        if len(token_ids) > self.max_model_len:
            raise InvalidRequest(
                f"{len(token_ids)} tokens: more than the context length (max_model_len) of {self.max_model_len}",
                param="tokens",
            )
        self._check_vocabulary(token_ids, "tokens")
        return self.tokenizer.decode(token_ids)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequest("messages must be a non-empty list", param="messages")
        if len(messages) > self.max_model_len:  # each costs a token or more of markup, whatever its content
            raise InvalidRequest(f"{len(messages)} messages: more than the {self.max_model_len}-token context "
                                 "(max_model_len) can hold", param="messages")  # fmt: skip
        num_chars = 0
        normalized = []
        for message in messages:
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise InvalidRequest("each message must be an object with a string 'role'", param="messages")
            content = message.get("content")
            if not isinstance(content, str):  # OpenAI's other spellings: an assistant's null, a list of text parts
                message = {**message, "content": _text_of_parts(content, message["role"])}
            normalized.append(message)
            num_chars += len(message["content"])
            num_chars += len(repr(message["tool_calls"])) if message.get("tool_calls") else 0
        self._check_chars(num_chars + len(repr(template_kwargs.get("tools") or "")), "messages")
        if not self.tokenizer.chat_template:
            raise InvalidRequest("this model has no chat template: use /v1/completions", param="messages")

        def render(conversation: list[Mapping[str, Any]]) -> list[int]:
            encoded = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs
            )
            return list(encoded["input_ids"] if isinstance(encoded, Mapping) or hasattr(encoded, "keys") else encoded)

        try:
            token_ids = render(normalized)
        except Exception as error:  # jinja raises its own errors for conversations a template rejects
            _check_unicode(normalized)
            rejection = f"the chat template rejected the messages: {_first_line(error)}"
            merged = merged_turns(normalized)
            if merged == normalized:
                raise InvalidRequest(rejection, "messages") from None
            try:
                token_ids = render(merged)
            except Exception:
                raise InvalidRequest(rejection, "messages") from None
        instructions = [m["content"] for m in normalized if m["role"] in ("system", "developer")]
        if len(instructions) == len(normalized) and not self._shows(token_ids, instructions):
            # Gemma's template writes its system message into the first user turn: with none, it drops it
            token_ids = render([{"role": "user", "content": "\n\n".join(instructions)}])
        return token_ids

    def _shows(self, token_ids: list[int], texts: list[str]) -> bool:
        prompt = self.tokenizer.decode(token_ids)
        return all(text.strip() in prompt for text in texts)

    # ---- checks --------------------------------------------------------------------------------------
    def _context_is(self) -> str:
        """OpenAI's words for a request over the context (clients such as litellm and LangChain match them)."""
        return f"This model's maximum context length is {self.max_model_len} tokens ({self.context_limit})."

    def _check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise InvalidRequest(
                f"{self._context_is()} However, {_subject(param)} {num_chars} characters: more than "
                f"it can hold. Please reduce the length of the {param}.",
                param=param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    def _check_vocabulary(self, token_ids: list[int], param: str) -> None:
        vocab = self.vocab_size
        for token_id in token_ids:
            if not is_token_id(token_id):
                raise InvalidRequest(f"token ids are integers, not {type(token_id).__name__} ({token_id!r})", param)
            if not 0 <= token_id < vocab:
                raise InvalidRequest(f"token id {token_id!r} is outside the vocabulary [0, {vocab})", param=param)

    def _check_num_tokens(self, num_prompt: int, param: str) -> None:
        if num_prompt >= self.max_model_len:
            raise InvalidRequest(
                f"{self._context_is()} However, {_subject(param)} {num_prompt} tokens, and at least "
                f"one token must be left for the output. Please reduce the length of the {param}.",
                param=param,
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    def _prepare(
        self, request_id: str, prompt: list[int], params: SamplingParams, param: str, is_chat: bool
    ) -> PreparedRequest:
        if not isinstance(request_id, str):
            raise InvalidRequest(f"request_id must be a string, not {type(request_id).__name__}")
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params must be a SamplingParams")
        params.check()
        # A snapshot: the caller's object may be changed, or reused for its next request, while this one runs (the
        # sequences and the detokenizer's stop strings read these; a NaN set later failed every request of a step).
        params = copy.deepcopy(params)
        if not prompt:
            raise InvalidRequest(f"{param} must not be empty (this model's tokenizer adds no start token to begin from)",
                                 param=param)  # fmt: skip
        self._check_num_tokens(len(prompt), param)
        max_tokens = self.check_lengths(len(prompt), params)
        phase = self._first_phase(prompt, is_chat)
        matcher = self.compile_grammar(params.structured_outputs, phase) if params.structured_outputs else None
        return PreparedRequest(request_id, prompt, params, max_tokens, matcher, phase)

    def compile_grammar(self, structured: StructuredOutputs, phase: Phase) -> Any:
        """A fresh matcher for an output that starts in `phase` (after the thought, with this engine's markers)."""
        return self.grammar_compiler.compile(structured, self.thought_markers, phase)

    def _first_phase(self, prompt: list[int], is_chat: bool) -> Phase:
        """Where the output starts, read from the prompt's last tokens (no decode without a parser)."""
        if self.reasoning_syntax is None:
            return Phase.ANSWER
        return first_phase(self.reasoning_syntax, self.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:]), is_chat)

    def check_lengths(self, num_prompt: int, params: SamplingParams) -> int:
        """The effective max_tokens of a request whose prompt fits; InvalidRequest for what cannot be honoured."""
        room = self.max_model_len - num_prompt
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequest(
                f"{self._context_is()} However, you requested {num_prompt + max_tokens} tokens "
                f"({num_prompt} in the prompt, {max_tokens} in max_tokens). Please reduce the length of the prompt "
                f"or max_tokens.",
                param="max_tokens",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        if params.min_tokens > max_tokens:
            raise InvalidRequest(
                f"min_tokens ({params.min_tokens}) is more than the {max_tokens} output tokens this request can have",
                param="min_tokens",
            )
        for token_id in params.stop_token_ids:
            if token_id >= self.vocab_size:
                raise InvalidRequest(
                    f"stop token id {token_id} is outside the vocabulary [0, {self.vocab_size})", "stop_token_ids"
                )
        for token_id in params.logit_bias or ():
            if token_id >= self.vocab_size:
                raise InvalidRequest(
                    f"logit_bias token id {token_id} is outside the vocabulary [0, {self.vocab_size})", "logit_bias"
                )
        if self.max_num_seqs is not None and params.n > self.max_num_seqs:
            raise InvalidRequest(f"n ({params.n}) is more than max_num_seqs ({self.max_num_seqs})", "n")
        return max_tokens


def _check_unicode(messages: list[Mapping[str, Any]]) -> None:
    """InvalidRequest naming the first message whose text is not UTF-8 (a lone surrogate): the tokenizer refuses it
    with a TypeError that would read as the chat template's own refusal."""
    for i, message in enumerate(messages):
        try:
            message["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"messages[{i}].content is not valid Unicode text (a lone surrogate?)",
                                 param="messages") from None  # fmt: skip


def _first_line(error: BaseException, max_chars: int = 200) -> str:
    """A template's own message, without the traceback-like detail some jinja errors carry; a long one is cut at a
    word's end (it may echo a message's text)."""
    text = str(error).strip().splitlines()
    if not text:
        return type(error).__name__
    line = text[0]
    if len(line) <= max_chars:
        return line
    cut = line[:max_chars]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut) + " ..."


def _subject(param: str) -> str:
    """'the prompt has' / 'the messages have': the start of a sentence about a request's text."""
    return f"the {param} have" if param.endswith("s") else f"the {param} has"


def is_token_id(value: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def as_token_list(prompt: Any) -> Any:
    """A numpy array or torch tensor of token ids as a list (their elements as they are); anything else as is."""
    return prompt.tolist() if hasattr(prompt, "tolist") and not isinstance(prompt, (str, list)) else prompt


def merged_turns(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Each run of plain messages (role and content only) of one role as one message, their texts a blank line
    apart; system and developer count as one role. For the templates that insist on alternating turns (Gemma's
    takes one system message, then user and assistant by turns): a conversation they reject as sent is rendered
    so, as its author meant it, rather than refused."""
    merged: list[Mapping[str, Any]] = []
    for message in messages:
        role = "system" if message["role"] == "developer" else message["role"]
        is_plain = set(message) <= {"role", "content"}
        last = merged[-1] if merged else None
        if is_plain and last is not None and last["role"] == role and set(last) <= {"role", "content"}:
            merged[-1] = {"role": role, "content": f"{last['content']}\n\n{message['content']}"}
        else:
            merged.append({**message, "role": role} if is_plain else message)
    return merged


def join_text_parts(texts: Iterable[str]) -> str:
    """A message's text parts as one text: a line apart, as vLLM joins them."""
    return "\n".join(texts)


def _text_of_parts(content: Any, role: str) -> str:
    if content is None and role == "assistant":  # a turn of tool calls alone
        return ""
    # an assistant's refusal part ({"type": "refusal", "refusal": ...}, OpenAI's other assistant content) reads as
    # its text, as in vLLM
    is_text = isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") in _TEXT_FIELD and isinstance(p.get(_TEXT_FIELD[p["type"]]), str)
        for p in content
    )
    if not is_text:
        raise InvalidRequest("each message's 'content' must be a string or a list of text parts "
                             '({"type": "text", "text": ...}); null for an assistant only', param="messages")  # fmt: skip
    return join_text_parts(part[_TEXT_FIELD[part["type"]]] for part in content)


_TEXT_FIELD = {"text": "text", "refusal": "refusal"}  # a content part's type -> the field that holds its text


def chat_template_options(
    add_generation_prompt: bool, continue_final_message: bool, variables: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """vLLM's switches as the template's arguments: continue_final_message leaves the last message open for the
    model to go on (an assistant's words put in its mouth) and implies no generation prompt. variables: a
    request's chat_template_kwargs (vLLM's), more variables for the template, such as Qwen 3's enable_thinking."""
    switches = {"add_generation_prompt": add_generation_prompt}
    if continue_final_message:
        switches = {"add_generation_prompt": False, "continue_final_message": True}
    return {**_template_variables(variables), **switches}


# apply_chat_template's own arguments: a request sets them through its fields (or not at all), never as variables
_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


def _template_variables(variables: Mapping[str, Any] | None) -> dict[str, Any]:
    if variables is None:
        return {}
    if not isinstance(variables, Mapping):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    for name in variables:
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidRequest(f"chat_template_kwargs: {name!r} is not a template variable's name",
                                 param="chat_template_kwargs")  # fmt: skip
        if name in _TEMPLATE_ARGUMENTS:
            raise InvalidRequest(f"chat_template_kwargs may not set {name!r}: it is an argument of the template's "
                                 "rendering, set by the request's own fields", param="chat_template_kwargs")  # fmt: skip
    return dict(variables)
