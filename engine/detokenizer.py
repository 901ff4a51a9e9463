"""Incremental detokenization: well-formed UTF-8 deltas, stop strings (and a reasoning parser's markers) held back
until they cannot match."""

from __future__ import annotations

import codecs

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.token_bytes import is_byte_level, piece_bytes

# Prompt tokens fed to the stream first, so that the first output token decodes in context
# (a SentencePiece "▁word" keeps its leading space after a prompt, as in a full decode).
NUM_CONTEXT_TOKENS = 4
# How many of the prompt's last tokens a context may leave out to end on a whole character.
MAX_CONTEXT_SHIFT = 8


class IncrementalDetokenizer:
    """Turns one token at a time into text deltas.

    `tokenizers`' DecodeStream holds back bytes of a character split across tokens; this class adds the
    stop-string logic: the longest tail of the text that could still begin a stop string is held back. Markers
    (a reasoning parser's <think> and </think>) are held back the same way but never stop the output, so that
    every delta holds a marker whole or not at all.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        markers: tuple[str, ...] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = _primed_stream(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._markers = markers
        self._stop_and_markers = (*stop, *markers)
        self._skip_special_tokens = skip_special_tokens
        self._byte_level = is_byte_level(tokenizer)  # asked once: held tokens ask for their bytes on every step
        self._held = ""  # decoded text not yet emitted: it may be the start of a stop string or a marker
        self._pending: list[int] = []  # tokens the stream holds: their text so far ends inside a character
        self.text = ""  # everything emitted so far

    def step(self, token_id: int, can_stop: bool = True) -> tuple[str, str | None]:
        """Feed one token. Returns (text delta, the stop string that matched or None).

        With can_stop False (min_tokens not reached yet) stop strings are not looked for.
        """
        piece = self._stream.step(self._tokenizer, token_id)
        if piece is None:
            self._pending.append(token_id)
            if self._stop and can_stop and self._may_hold_text():  # a literal U+FFFD may complete a stop string
                text = self._held + self._unfinished_text(is_cut=True)  # final: no token changes text before it
                if self._find_stop(text) is not None:
                    self._pending.clear()
                    return self._emit(text, can_stop)
            return "", None
        self._pending.clear()
        return self._emit(self._held + piece, can_stop)

    def flush(self, is_cut: bool = True) -> str:
        """At the end: release a held partial stop match, then what the stream still holds. Bytes that make no
        character are U+FFFD, as in a full decode; a last character's start too, unless max_tokens cut it
        (is_cut: then it is dropped, as vLLM does). A stop string in that text ends it there."""
        tail = self._held + self._unfinished_text(is_cut)
        self._held, self._pending = "", []
        match = self._find_stop(tail) if self._stop else None
        if match is not None:
            index, stop = match
            tail = tail[: index + len(stop)] if self._include_stop else tail[:index]
        self.text += tail
        return tail

    def _may_hold_text(self) -> bool:
        """Whether the tokens the stream holds may spell whole text (a literal U+FFFD): not when they are the first
        bytes of one character, which is why it holds them nearly always (a cheaper look than decoding them)."""
        pieces = _pieces_bytes(self._tokenizer, self._pending, self._byte_level)
        if pieces is None:
            return True
        try:
            b"".join(pieces).decode("utf-8")  # type: ignore[arg-type]
        except UnicodeDecodeError as error:
            return not (error.start == 0 and error.reason == "unexpected end of data")
        return True

    def _unfinished_text(self, is_cut: bool) -> str:
        # The pending tokens start on a character boundary (the stream emitted everything before them), unless the
        # prompt ended inside a character they never finished: their first bytes then show as U+FFFD.
        if not self._pending:
            return ""
        skip = self._skip_special_tokens
        kept = [t for t in self._pending if not (skip and self._tokenizer.decode([t], skip_special_tokens=True) == "")]
        pieces = _pieces_bytes(self._tokenizer, kept, self._byte_level, whole=False)
        # Tokens up to the last whose piece does not spell its bytes (a literal U+FFFD, a word) in the tokenizer's
        # own text of them; the bytes after it with one U+FFFD per run that makes no character (as a byte-level
        # decode shows them), by a decoder that, not told the input is final, keeps back the start of a last
        # character: the one max_tokens cut.
        split = max((i + 1 for i, piece in enumerate(pieces) if piece is None), default=0)
        head = self._tokenizer.decode(kept[:split], skip_special_tokens=skip) if split else ""
        data = b"".join(piece for piece in pieces[split:] if piece is not None)
        return head + codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=not is_cut)

    def _emit(self, text: str, can_stop: bool) -> tuple[str, str | None]:
        can_stop = can_stop and bool(self._stop)
        if not can_stop and not self._markers:
            self._held = ""
            self.text += text
            return text, None
        match = self._find_stop(text) if can_stop else None
        if match is not None:
            index, stop = match
            delta = text[: index + len(stop)] if self._include_stop else text[:index]
            self._held = ""
            self.text += delta
            return delta, stop
        num_held = self._num_possible_stop_start(text, self._stop_and_markers if can_stop else self._markers)
        cut = self._cut_outside_markers(text, len(text) - num_held)
        delta, self._held = text[:cut], text[cut:]
        self.text += delta
        return delta, None

    def _cut_outside_markers(self, text: str, cut: int) -> int:
        """cut, or the start of a whole marker it falls inside: a stop string may begin with a marker's last
        characters (">>>" after "</think>" held its ">"), and a marker split between deltas is never seen by the
        reasoning splitter (the answer then stayed in the thought)."""
        is_moved = True
        while is_moved:
            is_moved = False
            for marker in self._markers:
                start = text.find(marker, max(0, cut - len(marker) + 1))
                if start != -1 and start < cut:
                    cut, is_moved = start, True
        return cut

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = text.find(stop)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _num_possible_stop_start(self, text: str, held_for: tuple[str, ...]) -> int:
        """Length of the longest suffix of text that is a proper prefix of some string of held_for.

        Only suffixes starting with a stop string's first character are compared, so a token costs a few
        C-level searches per stop string rather than one comparison per possible length (16 stop strings of
        256 characters would otherwise be ~4,000 Python-level calls per token, on the event loop).
        """
        longest = 0
        for stop in held_for:
            start = len(text) - min(len(stop) - 1, len(text))
            index = text.find(stop[0], start)
            while index != -1 and len(text) - index > longest:
                if stop.startswith(text[index:]):
                    longest = len(text) - index  # candidates only get shorter from here
                    break
                index = text.find(stop[0], index + 1)
        return longest


def _primed_stream(tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> DecodeStream:
    """A DecodeStream that starts after the prompt's text. It emits what follows the text of the tokens it starts
    with, and takes no such text from tokens whose text ends in U+FFFD: its first delta would then repeat the
    prompt's tail. So it starts with the prompt's last few tokens that end on a whole character; the tokens after
    them are stepped through (their text dropped) only when they begin a character the output may finish, and
    left out when they are whole (a real U+FFFD in the prompt)."""
    num_prompt = len(prompt_token_ids)
    for end in range(num_prompt, max(0, num_prompt - MAX_CONTEXT_SHIFT) - 1, -1):
        context = prompt_token_ids[max(0, end - NUM_CONTEXT_TOKENS) : end]
        if not tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            break
    else:
        context, end = [], num_prompt
    stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)
    tail = prompt_token_ids[end:]
    if tail and _begins_a_character(tokenizer, tail):
        for token_id in tail:
            stream.step(tokenizer, token_id)
    return stream


def _pieces_bytes(
    tokenizer: Tokenizer, token_ids: list[int], byte_level: bool, whole: bool = True
) -> list[bytes | None] | None:
    """Each token's bytes, None for a piece that does not spell them (whole: then None for all)."""
    pieces = [piece_bytes(tokenizer.id_to_token(t) or "", byte_level) for t in token_ids]
    return None if whole and any(p is None for p in pieces) else pieces


def _begins_a_character(tokenizer: Tokenizer, token_ids: list[int]) -> bool:
    """Whether the tokens' bytes end inside a UTF-8 character (False where a token's piece does not spell its
    bytes)."""
    pieces = _pieces_bytes(tokenizer, token_ids, is_byte_level(tokenizer))
    if pieces is None:
        return False
    try:
        b"".join(pieces).decode("utf-8")  # type: ignore[arg-type]
    except UnicodeDecodeError as error:
        return error.reason == "unexpected end of data"
    return False
