"""Reasoning parsers (vLLM's --reasoning-parser): a thought the model writes between <think> and </think> split
from its answer, delta by delta.

The engine's detokenizer holds back a possible partial marker as it holds back a stop string (engine/detokenizer.py),
so every text delta fed here holds whole markers or none: the splitter needs cheap string searches only.

Where a thought starts (vLLM's rules, one choice per parser):
- qwen3: a thought is one the output opens with <think>, or one the prompt left open (a template that ends the
  prompt with "<think>\\n"). Output with no thought is all content.
- deepseek_r1: the output is a thought from its start (a <think> there is dropped) up to </think>; with no
  </think> it is all thought. That is its chat templates' rule: a prompt no template rendered (/v1/completions,
  LLM.generate) opens no thought of itself, and has one only as qwen3 would (the output or the prompt opens it).
Either way a prompt that ends with a closed thought (Qwen 3's enable_thinking false: "<think>\\n\\n</think>\\n\\n")
makes the output all content, and a thought that is never closed (max_tokens, a stop string) is all reasoning.
Only the first thought counts: markers after it are content, as vLLM splits at the first </think>.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningSyntax:
    name: str
    start: str
    end: str
    is_thought_at_start: bool  # output that does not open a thought is one anyway (DeepSeek R1's templates)

    @property
    def markers(self) -> tuple[str, str]:
        return self.start, self.end


REASONING_PARSERS = {
    "qwen3": ReasoningSyntax("qwen3", THINK_START, THINK_END, is_thought_at_start=False),
    "deepseek_r1": ReasoningSyntax("deepseek_r1", THINK_START, THINK_END, is_thought_at_start=True),
}


def reasoning_syntax(name: str) -> ReasoningSyntax | None:
    """The configured parser ("" = off). Raises ValueError naming the choices."""
    if not name:
        return None
    syntax = REASONING_PARSERS.get(name)
    if syntax is None:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} or \"\" (off), got {name!r}")
    return syntax


def marker_token_ids(tokenizer: Any, syntax: ReasoningSyntax) -> dict[str, int]:
    """The markers the tokenizer holds as single tokens, by text. Raises ValueError (a start that fails) when a
    marker does not come back as text from its own tokens, as the detokenizer decodes them (a special token
    is skipped there)."""
    ids: dict[str, int] = {}
    for marker in syntax.markers:
        token_ids = tokenizer.encode(marker, add_special_tokens=False)
        if tokenizer.decode(token_ids, skip_special_tokens=True) != marker:
            raise ValueError(f"reasoning_parser {syntax.name}: the tokenizer does not give {marker!r} back as text "
                             f"(tokens {token_ids[:8]}; a special token is left out of the output): this model does "
                             "not write its thought between those markers")  # fmt: skip
        if len(token_ids) == 1:
            ids[marker] = token_ids[0]
    return ids


class Phase(enum.Enum):
    BEFORE = "before"  # nothing but whitespace yet, and a thought may still open (<think>)
    OPENING = "opening"  # a thought from the start; nothing but whitespace yet, a <think> may still come
    THOUGHT = "thought"
    ANSWER = "answer"


def first_phase(syntax: ReasoningSyntax, prompt_tail: str, is_chat: bool = True) -> Phase:
    """Where the output starts, from the prompt's last characters (its last few tokens' text); is_chat: a chat
    template rendered the prompt (else a thought from the start is not assumed: a grammar would wait for a </think>
    that a plain completion never writes)."""
    tail = prompt_tail.rstrip()
    if tail.endswith(syntax.end):
        return Phase.ANSWER  # the template closed the thought (enable_thinking false): all content
    if tail.endswith(syntax.start):
        return Phase.OPENING
    return Phase.OPENING if syntax.is_thought_at_start and is_chat else Phase.BEFORE


class ReasoningSplitter:
    """One choice's output split into (reasoning, content) pieces as its text deltas come.

    Leading whitespace is held until it is known to belong to the thought (dropped before a <think>) or not.
    num_reasoning_tokens counts the tokens of the thought, markers included: exact when the end marker is one token;
    else the closing delta's tokens up to the one whose text (token_piece) completes the marker, or all of them when
    the marker began in an earlier delta."""

    __slots__ = ("syntax", "phase", "num_reasoning_tokens", "has_thought", "_end_id", "_piece", "_space")

    def __init__(
        self, syntax: ReasoningSyntax, phase: Phase, end_token_id: int | None = None,
        token_piece: Callable[[int], str] | None = None,
    ) -> None:  # fmt: skip
        self.syntax = syntax
        self.phase = phase
        self.num_reasoning_tokens = 0
        self.has_thought = phase is Phase.OPENING  # whether the output has a thought (reasoning not null)
        self._end_id = end_token_id
        self._piece = token_piece
        self._space = ""  # leading whitespace held in BEFORE / OPENING

    @property
    def is_in_thought(self) -> bool:
        return self.phase in (Phase.OPENING, Phase.THOUGHT)

    def feed(self, text: str, token_ids: list[int] | None = None) -> tuple[str, str]:
        """(reasoning, content) of one delta's text; token_ids are the delta's tokens (counted)."""
        phase = self.phase
        if phase is Phase.ANSWER:
            return "", text
        was_in_thought = phase is not Phase.BEFORE
        reasoning, content = "", ""
        if phase is not Phase.THOUGHT:
            text = self._space + text
            stripped = text.lstrip()
            if not stripped:  # whitespace only: wait for what follows it
                self._space = text
                self._count(token_ids, was_in_thought, None)
                return "", ""
            self._space = ""
            if stripped.startswith(self.syntax.start):
                text = stripped[len(self.syntax.start) :]
                self.has_thought, was_in_thought = True, True
            elif phase is Phase.BEFORE:  # qwen3: an answer with no thought
                self.phase = Phase.ANSWER
                return "", text
            self.phase = Phase.THOUGHT
        end = text.find(self.syntax.end)
        if end == -1:
            reasoning = text
        else:
            reasoning, content = text[:end], text[end + len(self.syntax.end) :]
            self.phase = Phase.ANSWER
        self._count(token_ids, was_in_thought, end != -1)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held at the end: whitespace, the thought's (OPENING) or the answer's (BEFORE)."""
        space, self._space = self._space, ""
        return (space, "") if self.phase is Phase.OPENING else ("", space)

    def _count(self, token_ids: list[int] | None, was_in_thought: bool, is_closed: bool | None) -> None:
        if not token_ids:
            return
        if is_closed:
            self.num_reasoning_tokens += self._num_through_end(token_ids)
        elif was_in_thought or self.has_thought:
            self.num_reasoning_tokens += len(token_ids)

    def _num_through_end(self, token_ids: list[int]) -> int:
        if self._end_id is not None:
            return token_ids.index(self._end_id) + 1 if self._end_id in token_ids else len(token_ids)
        if self._piece is not None:
            end, tail = self.syntax.end, ""
            for i, token_id in enumerate(token_ids):
                tail += self._piece(token_id)
                if end in tail:
                    return i + 1
                tail = tail[1 - len(end) :]  # what may still begin the marker
        return len(token_ids)


def split_whole(splitter: ReasoningSplitter, text: str, token_ids: list[int]) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), None where there is none (vLLM's nulls)."""
    reasoning, content = splitter.feed(text, token_ids)
    more_reasoning, more_content = splitter.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return (reasoning if splitter.has_thought else None), (content or None)
