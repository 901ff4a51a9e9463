"""Per-choice state: tokens, KV progress, status. Pure Python; only the event-loop thread mutates it.

How a choice ended (its FinishReason, the stop string or token) is not kept here: the output processor puts it in
the choice's last delta (RequestOutput), and the async engine's Request records it per choice."""

from __future__ import annotations

import enum
import time

from engine.batch import SampledToken
from engine.detokenizer import IncrementalDetokenizer
from engine.grammar_clock import GrammarClock
from engine.input_processor import PreparedRequest
from engine.sampling_params import SamplingParams
from engine.speculative.speculator import SeqSpeculation


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks: prefilling or decoding
    FINISHED = "finished"


class Sequence:
    """One choice of a request (or a fork parent: see num_forks). Tokens [0, num_computed_tokens) have their
    KV in the blocks of block_table."""

    def __init__(
        self,
        seq_id: int,
        request: PreparedRequest,
        detokenizer: IncrementalDetokenizer | None,
        index: int = 0,
        params: SamplingParams | None = None,
        num_forks: int = 0,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request = request
        self.request_id = request.request_id
        self.index = index  # the choice this sequence produces, among the request's n
        # > 0: a fork parent, which only computes the prompt's leading full blocks (its prompt_token_ids),
        # samples nothing, and then forks into num_forks choices sharing those blocks by reference count.
        self.num_forks = num_forks
        self.prompt_token_ids = request.prompt_token_ids if prompt_token_ids is None else prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params = params or request.params
        self.max_tokens = request.max_tokens  # params.max_tokens, or what the context leaves when that is None
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.detokenizer = detokenizer
        # The grammar's state after every output token so far, or None. A preempted sequence is recomputed from
        # its prompt and outputs, whose tokens the matcher has already accepted: it stays as it is. Choices
        # other than the first get their own copy, made while the request's matcher has consumed nothing.
        matcher = request.matcher
        self.matcher = matcher.deep_copy() if matcher is not None and index > 0 else matcher
        self.grammar_clock = GrammarClock() if matcher is not None else None
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of all_token_ids, in order
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.is_first_admission = True
        self.logprobs: list[SampledToken] | None = [] if params.logprobs is not None else None
        # Per prompt position when asked for: the first token has none (nothing comes before it).
        self.prompt_logprobs: list[SampledToken | None] | None = [None] if params.prompt_logprobs is not None else None
        self.arrival_time = time.monotonic()
        self.speculation: SeqSpeculation | None = None  # the speculator's state, made at its first proposal

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_seats(self) -> int:
        """Places in the running batch (max_num_seqs) this sequence stands for: a fork parent takes its choices'."""
        return self.num_forks or 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole concatenation."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
