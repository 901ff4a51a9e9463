"""The synchronous engine: add_request / abort / step. The offline API and the async server shell drive it.

A request flows one way: InputProcessor (tokenize and check, once) -> add_prepared -> the scheduler ->
step() -> OutputProcessor (detokenize, stop, finish). step() is three calls: schedule_step() and finish_step()
run on the caller's (event-loop) thread and own all scheduler and block state; execute() is the forward pass
only and may run in a worker thread. Aborts are applied between steps, never while a forward pass runs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.batch import PromptScoring, SampledToken, SamplingRow, SeqChunk, StepBatch, StepOutput
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.fork import choice_params, fork_point
from engine.input_processor import InputProcessor, Prompt, PreparedRequest
from engine.loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.output_processor import STRUCTURED_OUTPUT_FAILED, GrammarViolation, OutputProcessor
from engine.outputs import FinishReason, RequestOutput
from engine.reasoning_parser import marker_token_ids, reasoning_syntax
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, Scheduler
from engine.sequence import Sequence
from engine.speculative.speculator import Speculator
from engine.speculative.stats import SpeculationStats
from engine.speculative.verify import num_accepted, verify_rows
from engine.thought_grammar import thought_markers

logger = logging.getLogger(__name__)

# What a client is told when its request fails inside the engine; the log has the details.
OUTPUT_FAILED = "the server failed while producing this request's output"
FORWARD_FAILED = "the server failed while computing this request's next token"


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk]
    batch: StepBatch
    elapsed: float = 0.0  # seconds the forward pass took (set by execute)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = loaded or load_model(config)
        self.model_name = loaded.name
        self.model_path = loaded.path
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.reasoning_syntax = reasoning_syntax(config.reasoning_parser)
        marker_ids: dict[str, int] = {}
        if self.reasoning_syntax is not None:  # the markers must come out as text: else the start fails here
            marker_ids = marker_token_ids(self.tokenizer, self.reasoning_syntax)
        # Held back by every detokenizer while they may be partial: the web layer's splitter sees them whole.
        self._held_markers = self.reasoning_syntax.markers if self.reasoning_syntax is not None else ()
        kv_capacity = config.num_kv_blocks * config.block_size
        self.max_model_len = min(config.max_model_len, loaded.max_position_embeddings, kv_capacity)
        is_cut_by_pool = self.max_model_len < min(config.max_model_len, loaded.max_position_embeddings)
        if is_cut_by_pool:
            logger.warning("max_model_len is cut to %d tokens: the KV pool holds no more (num_kv_blocks %d x "
                           "block_size %d); more blocks allow longer contexts", kv_capacity, config.num_kv_blocks,
                           config.block_size)  # fmt: skip
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, self.eos_token_ids,
                                              config.max_num_seqs, loaded.longest_token_chars)  # fmt: skip
        self.input_processor.reasoning_syntax = self.reasoning_syntax
        self.input_processor.thought_markers = thought_markers(self.reasoning_syntax, marker_ids)
        if is_cut_by_pool:
            pool = f"num_kv_blocks {config.num_kv_blocks} x block_size {config.block_size}"
            self.input_processor.context_limit = f"max_model_len, cut to what the KV pool holds: {pool}"
        self.output_processor = OutputProcessor(self.eos_token_ids, self.max_model_len, self.tokenizer.eos_token_id)
        self.runner = ModelRunner(loaded, config)
        logger.info("KV pool %d blocks x %d tokens, max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, "
                    "%d threads", config.num_kv_blocks, config.block_size, self.max_model_len, config.max_num_seqs,
                    config.max_num_batched_tokens, self.runner.num_threads)  # fmt: skip
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.speculator = Speculator(config.speculative_config, self.max_model_len)
        self.scheduler = Scheduler(config, self.block_manager, self.speculator)
        self._learns_step_cost = config.speculative == "auto"
        if self._learns_step_cost:
            self._probe_step_cost()
        self.requests: dict[str, list[Sequence]] = {}  # request id -> its live sequences (choices, or a fork parent)
        self._seq_ids = itertools.count()
        self._plan: StepPlan | None = None  # the step whose forward pass is running

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, is_chat: bool = False) -> None:
        """Tokenize and check, then queue. Raises InvalidRequest (a ValueError) before any state changes. is_chat:
        a chat template rendered the prompt (where a reasoning model's thought starts: engine/reasoning_parser.py)."""
        self.add_prepared(self.input_processor.process_prompt(request_id, prompt, params, is_chat))

    def add_prepared(self, request: PreparedRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        n = request.params.n
        num_shared = fork_point(len(request.prompt_token_ids), self.config.block_size) if n > 1 else 0
        if num_shared:
            prefix = request.prompt_token_ids[:num_shared]
            seqs = [Sequence(next(self._seq_ids), request, None, num_forks=n, prompt_token_ids=prefix)]
        else:
            seqs = self._choices(request)
        self.requests[request.request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """End a request now and free its blocks. Idempotent: the final delta of each choice still live ([] if
        the request is not live).

        Only between steps: the forward pass reads the blocks of the step's requests."""
        if self._plan is not None:
            raise RuntimeError("abort() during a forward pass: apply aborts between steps")
        outputs = []
        for seq in self.requests.pop(request_id, []):
            self.scheduler.finish(seq)
            outputs += self.output_processor.final(seq, FinishReason.ABORT)
        return outputs

    def abort_all(self) -> list[RequestOutput]:
        return [out for request_id in list(self.requests) for out in self.abort(request_id)]

    # ---- stepping -------------------------------------------------------------------------------------
    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def is_step_running(self) -> bool:
        return self._plan is not None

    def step(self, on_failed: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """One step. A forward pass that raises fails its requests and the error is raised here; their final deltas
        go to on_failed first (a caller stepping for others hands them on), as do the "abort" ones of an interrupt."""
        plan = self.schedule_step()
        if plan is None:
            return []
        try:
            output = self.execute(plan)
        except Exception as error:
            failed = self.fail_step(plan, error)
            if on_failed is not None:
                on_failed(failed)
            raise
        except BaseException:  # KeyboardInterrupt in the caller's thread: the step's tokens are lost
            interrupted = self.interrupt_step(plan)
            if on_failed is not None:
                on_failed(interrupted)
            raise
        return self.finish_step(plan, output)

    def schedule_step(self) -> StepPlan | None:
        assert self._plan is None, "the previous step has not finished"
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        batch = StepBatch([self._seq_chunk(c) for c in chunks])
        self._plan = StepPlan(chunks, batch)
        return self._plan

    def execute(self, plan: StepPlan) -> StepOutput:
        start = time.perf_counter()
        output = self.runner.run(plan.batch)
        plan.elapsed = time.perf_counter() - start
        return output

    def finish_step(self, plan: StepPlan, output: StepOutput) -> list[RequestOutput]:
        """Apply a forward pass's tokens: one delta per sampling sequence (a verification's accepted tokens
        in one delta); finished ones are freed."""
        self._plan = None
        if self._learns_step_cost:
            self._observe_step_cost(plan)
        emitted = self._accept(plan, output.sampled)
        self.scheduler.on_computed(plan.chunks)
        for scheduled in plan.chunks:
            if scheduled.seq.num_forks and not scheduled.seq.num_uncomputed_tokens:
                self._fork(scheduled.seq)
        for scheduled, chunk in zip(plan.chunks, plan.batch.chunks):
            scored = output.prompt_logprobs.get(chunk.seq_id)
            if scored is not None:
                _keep_prompt_logprobs(scheduled.seq, chunk.start_pos + 1, scored)
        outputs = []
        for seq, tokens in emitted:
            try:
                out = self._on_tokens(seq, tokens)
            except GrammarViolation as error:  # a grammar past llguidance's limits: its words are the client's
                logger.warning("request %s: %s", seq.request_id, error)
                (out,) = self.output_processor.final(seq, FinishReason.ERROR, f"structured output failed: {error}",
                                                     error_code=STRUCTURED_OUTPUT_FAILED)  # fmt: skip
            except Exception:  # one request's output failing fails that request alone
                logger.exception("producing the output of request %s failed", seq.request_id)
                (out,) = self.output_processor.final(seq, FinishReason.ERROR, OUTPUT_FAILED)
            if out.finish_reason is not None:
                self._finish(seq, out.finish_reason)
            outputs.append(out)
        return outputs

    def _accept(self, plan: StepPlan, sampled: list[SampledToken]) -> list[tuple[Sequence, list[SampledToken]]]:
        """Each sampling sequence with the tokens it gains: its sampled token, or a verification's accepted
        drafts and the token sampled after them (each chunk's num_accepted is set here)."""
        emitted = []
        i = 0
        for scheduled, chunk in zip(plan.chunks, plan.batch.chunks):
            if chunk.verify_rows is not None:
                rows = sampled[i : i + len(chunk.verify_rows)]
                i += len(chunk.verify_rows)
                drafts = scheduled.draft_token_ids
                scheduled.num_accepted = accepted = num_accepted(drafts, rows)
                self.speculator.on_verified(scheduled.seq, len(drafts), accepted)
                emitted.append((scheduled.seq, rows[: accepted + 1]))
            elif chunk.sampling is not None:
                emitted.append((scheduled.seq, sampled[i : i + 1]))
                i += 1
        if i != len(sampled):
            raise RuntimeError(f"the runner sampled {len(sampled)} tokens for {i} rows")
        return emitted

    def _on_tokens(self, seq: Sequence, tokens: list[SampledToken]) -> RequestOutput:
        """The tokens one step gave seq, as one delta (burst-atomic: a stream sends them as one event); tokens
        after the one that finishes seq are dropped."""
        out = self.output_processor.on_token(seq, tokens[0])
        for token in tokens[1:]:
            if out.finished:
                break
            out.absorb(self.output_processor.on_token(seq, token))
        return out

    def _observe_step_cost(self, plan: StepPlan) -> None:
        """Decode and verification steps teach "auto" speculation what a row costs (prefill chunks, whose
        attention grows with their length, would blur it)."""
        max_rows = self.config.speculative_k + 1
        num_rows = 0
        for chunk in plan.batch.chunks:
            if chunk.num_tokens > max_rows:
                return
            num_rows += chunk.num_tokens
        self.speculator.on_step(num_rows, plan.elapsed)

    def _probe_step_cost(self) -> None:
        """Time a few decode-like steps of 1 and of 1 + k rows (with their logits), so that "auto" speculation
        starts from this machine's costs. Only the first few blocks are written, and nothing holds them yet."""
        block_size = self.config.block_size
        # 4 blocks, or as many as 1 + k rows need (blocks of 1 or 2 tokens); the rows stay inside the context
        # (the native step has no position past max_model_len) and the pool, which cap every verification too
        num_blocks = min(self.config.num_kv_blocks, max(4, -(-(self.config.speculative_k + 1) // block_size)))
        num_positions = min(num_blocks * block_size, 48, self.max_model_len)
        width = min(self.config.speculative_k + 1, num_positions)
        row = SamplingRow(0.0, -1, 1.0, 0.0, 0.0, 0.0, 1.0, None, None, 0, [], [])
        blocks = list(range(num_blocks))
        start = num_positions - width
        for num_rows in (1, width) * 3:
            chunk = SeqChunk(-1, [0] * num_rows, start, blocks, row, verify_rows=[row] * num_rows)
            begin = time.perf_counter()
            self.runner.run(StepBatch([chunk]))
            self.speculator.on_step(num_rows, time.perf_counter() - begin)

    def fail_step(self, plan: StepPlan, error: BaseException) -> list[RequestOutput]:
        """The forward pass raised: end every request of the step with an error and free its blocks."""
        self._plan = None
        logger.error("a forward pass failed (%s: %s); failing its %d requests", type(error).__name__, error,
                     len(plan.chunks))  # fmt: skip
        outputs = []
        for chunk in plan.chunks:
            seq = chunk.seq
            self._finish(seq, FinishReason.ERROR)
            outputs += self.output_processor.final(seq, FinishReason.ERROR, FORWARD_FAILED)
        return outputs

    def interrupt_step(self, plan: StepPlan) -> list[RequestOutput]:
        """The caller was interrupted during the forward pass (Ctrl-C): its requests end as aborted, their blocks
        freed, and the engine serves the next step. Returns their final deltas (a stream another call opened
        would otherwise end without one)."""
        self._plan = None
        outputs = []
        for chunk in plan.chunks:
            self._finish(chunk.seq, FinishReason.ABORT)
            outputs += self.output_processor.final(chunk.seq, FinishReason.ABORT)
        return outputs

    # ---- internals ------------------------------------------------------------------------------------
    def _choices(self, request: PreparedRequest) -> list[Sequence]:
        """The request's n choices, each with its own detokenizer (stop strings) and seed."""
        params = request.params
        return [
            Sequence(next(self._seq_ids), request, self._detokenizer(request), i, choice_params(params, i))
            for i in range(params.n)
        ]

    def _detokenizer(self, request: PreparedRequest) -> IncrementalDetokenizer:
        params = request.params
        return IncrementalDetokenizer(
            self.tokenizer.backend_tokenizer,
            request.prompt_token_ids,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
            self._held_markers,
        )

    def _fork(self, parent: Sequence) -> None:
        children = self._choices(parent.request)
        self.scheduler.fork(parent, children)
        self.requests[parent.request_id] = children

    def _seq_chunk(self, chunk: ScheduledChunk) -> SeqChunk:
        seq = chunk.seq
        start = seq.num_computed_tokens
        drafts = chunk.draft_token_ids
        token_ids = seq.token_slice(start, start + chunk.num_tokens - len(drafts))
        sampling = self._sampling_row(seq) if chunk.is_sampling else None
        verify = None
        if drafts:
            token_ids = token_ids + drafts
            verify = verify_rows(sampling, drafts, seq.params.min_tokens)
        scoring = None
        if seq.prompt_logprobs is not None:
            # Row i (position start + i) scores the prompt token at start + i + 1: up to the prompt's end.
            targets = seq.prompt_token_ids[start + 1 : start + chunk.num_tokens + 1]
            scoring = PromptScoring(targets, seq.params.prompt_logprobs or 0)
        return SeqChunk(seq.seq_id, token_ids, start, seq.block_table, sampling, scoring, verify)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens:
            banned = tuple(self.eos_token_ids | seq.stop_token_ids)
        return SamplingRow(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            seed=p.seed,
            num_logprobs=p.logprobs,
            num_output_tokens=seq.num_output_tokens,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            banned_token_ids=banned,
            logit_bias=p.logit_bias,
            matcher=seq.matcher,
            grammar_clock=seq.grammar_clock,
        )

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if reason is FinishReason.STOP or reason is FinishReason.LENGTH:
            self.speculator.on_finished(seq.output_token_ids)
        self.scheduler.finish(seq)
        live = self.requests[seq.request_id]
        live.remove(seq)
        if not live:
            del self.requests[seq.request_id]

    # ---- introspection --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Choices waiting: a request of n waits as n, its fork parent (its shared prompt) or its n sequences."""
        return sum(seq.num_seats for seq in self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Choices running, counted as num_waiting: a fork parent prefilling is its n choices."""
        return sum(seq.num_seats for seq in self.scheduler.running)

    @property
    def num_seats(self) -> int:
        """Places of max_num_seqs taken by the scheduler's sequences, waiting or running (n per request)."""
        return sum(seq.num_seats for seq in self.scheduler.waiting) + sum(s.num_seats for s in self.scheduler.running)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.block_manager.prefix_cache_hit_rate

    @property
    def speculation_stats(self) -> SpeculationStats:
        return self.speculator.stats

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def __repr__(self) -> str:
        return f"LLMEngine({self.model_name!r}, {self.num_running} running, {self.num_waiting} waiting)"


def _keep_prompt_logprobs(seq: Sequence, first_position: int, scored: list[SampledToken]) -> None:
    """Append the logprobs of prompt positions first_position, ...; positions already kept (a prefill
    recomputed after preemption) stay as they were."""
    assert seq.prompt_logprobs is not None and len(seq.prompt_logprobs) >= first_position, "a prompt gap"
    seq.prompt_logprobs += scored[len(seq.prompt_logprobs) - first_position :]


__all__ = ["LLMEngine", "StepPlan"]
