"""A request's grammar after a reasoning model's thought (vLLM starts the grammar after </think>).

With a reasoning parser, the grammar of structured outputs and forced tool calls shapes the answer only: the grammar
compiled is the request's own, preceded by a thought of free text up to the end marker's token. The thought is
grammar too, so the engine keeps no per-sequence gate: masks, speculation, preemption and the finish on a complete
grammar work as for any grammar. Where the output starts decides the thought's shape (engine/reasoning_parser.py):
- ANSWER (the prompt closed the thought: Qwen 3's enable_thinking false): no thought, the request's grammar as it is;
- BEFORE (qwen3, no thought open): an optional thought that opens with <think>, then the answer;
- OPENING (a thought the template left open, or deepseek_r1's): the thought (a leading <think> allowed), </think>,
  then the answer.
The thought's text never spells the end marker (the splitter would end it there, out of step with the grammar) and
holds no added tokens (llguidance reads those as tokens, never as text) nor EOS: a thought must end for the answer
the request asked for to come (vLLM lets an unconstrained thought end the output). Only a single-token end marker
is named so; else, and for a grammar that names the end marker itself (it shapes the thought too), the request's
grammar is compiled as it is, over the whole output.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.reasoning_parser import Phase, ReasoningSyntax

# The prompt's last tokens whose text tells where the output starts (first_phase): "<think>\n\n</think>\n\n" is 4
# tokens in Qwen 3's vocabulary, and more where the markers are not single tokens.
PROMPT_TAIL_TOKENS = 16
ANSWER_GRAMMAR = "sluice_answer"  # the request's grammar's name inside the wrapping one


@dataclass(frozen=True, slots=True)
class ThoughtMarkers:
    syntax: ReasoningSyntax
    end_token_id: int
    start_token_id: int | None  # None: <think> is text (spelt by several tokens)

    def names_end(self, lark: str) -> bool:
        """Whether a Lark grammar writes the end marker itself (by token id or text): it shapes the thought."""
        return f"<[{self.end_token_id}]>" in lark or self.syntax.end in lark


def thought_markers(syntax: ReasoningSyntax | None, marker_ids: dict[str, int]) -> ThoughtMarkers | None:
    """The markers a grammar can start after: None without a parser, or when the end marker is not one token."""
    if syntax is None or syntax.end not in marker_ids:
        return None
    return ThoughtMarkers(syntax, marker_ids[syntax.end], marker_ids.get(syntax.start))


def after_thought(answer: str, markers: ThoughtMarkers, phase: Phase) -> str:
    """The grammar (llguidance's TopLevelGrammar JSON) of a thought then `answer` (what grammar_text gives: Lark text
    or a TopLevelGrammar's JSON), for an output that starts in `phase` (not ANSWER)."""
    grammars = _grammars(answer)
    start = _token(markers.start_token_id, markers.syntax.start)
    end = f"<[{markers.end_token_id}]>"
    if phase is Phase.BEFORE:
        rule = f"start: ({start} THOUGHT {end})? @{ANSWER_GRAMMAR}"
    else:
        rule = f"start: {start}? THOUGHT {end} @{ANSWER_GRAMMAR}"
    not_end = _regex_literal(markers.syntax.end)
    thought = f"{rule}\nTHOUGHT: /(?s:.*)/ & ~/(?s:.*{not_end}.*)/\n"
    return json.dumps({"grammars": [{"lark_grammar": thought}, *grammars]})


def _grammars(answer: str) -> list[dict[str, Any]]:
    """The answer's grammars, the first (its start) named ANSWER_GRAMMAR."""
    if answer.lstrip().startswith("{"):  # a TopLevelGrammar (JSON schema, regex); Lark text never opens with "{"
        grammars = [dict(g) for g in json.loads(answer)["grammars"]]
    else:
        grammars = [{"lark_grammar": answer}]
    grammars[0]["name"] = ANSWER_GRAMMAR
    return grammars


def _token(token_id: int | None, text: str) -> str:
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def _regex_literal(text: str) -> str:
    return re.sub(r"([\\/.*+?()\[\]{}|^$])", r"\\\1", text)
