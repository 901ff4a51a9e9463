"""The synchronous engine: add_request / abort / step. The offline API and the async server shell drive it.

step() is three calls: schedule_step() and finish_step() run on the caller's (event-loop) thread and own all
scheduler and block state; execute() is the forward pass only and may run in a worker thread.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from engine.batch import SampledToken, SamplingRow, SeqChunk, StepBatch
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.models.loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, Scheduler
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk]
    batch: StepBatch


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = loaded or load_model(config)
        self.model_name = loaded.name
        self.model_dir = loaded.model_dir
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        kv_capacity = config.num_kv_blocks * config.block_size
        self.max_model_len = min(config.max_model_len, loaded.max_position_embeddings, kv_capacity)
        self.runner = ModelRunner(loaded, config)
        self.runner.warmup()
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.requests: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self._plan: StepPlan | None = None  # the step whose forward pass is running
        self._aborted_in_step: set[int] = set()

    # ---- requests -------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        for token_id in prompt:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError("each message must be an object with a string 'role'")
            if not isinstance(message.get("content"), str):
                raise ValueError("each message's 'content' must be a string")
        if not self.tokenizer.chat_template:
            raise ValueError(f"model {self.model_name!r} has no chat template")
        try:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as error:  # jinja raises its own errors for templates that reject a conversation
            raise ValueError(f"the chat template rejected the messages: {error}") from None
        token_ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
        return list(token_ids)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Raise ValueError unless the request fits the context; returns its effective max_tokens."""
        num_prompt = num_prompt_tokens
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens, but the context length (max_model_len) is "
                f"{self.max_model_len}: at least one token must be left for the output"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) is {num_prompt + max_tokens} "
                f"tokens, over the context length (max_model_len) of {self.max_model_len}"
            )
        for token_id in params.stop_token_ids:
            if token_id >= self.vocab_size:
                raise ValueError(f"stop token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return max_tokens

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Validate, then queue. Raises ValueError before any state changes."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        prompt_token_ids = self.encode_prompt(prompt)
        max_tokens = self.check_request(len(prompt_token_ids), params)
        detokenizer = IncrementalDetokenizer(
            self.tokenizer.backend_tokenizer,
            prompt_token_ids,
            params.stop,
            params.include_stop_str_in_output,
            params.skip_special_tokens,
        )
        seq = Sequence(next(self._seq_ids), request_id, prompt_token_ids, params, max_tokens, detokenizer)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now. Idempotent; returns its final delta if it was live, None otherwise."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        if self._plan is not None and any(c.seq is seq for c in self._plan.chunks):
            self._aborted_in_step.add(seq.seq_id)  # the forward pass reads its blocks: free them after the step
            seq.finish_reason = "abort"
        else:
            self.scheduler.finish(seq, "abort")
        return self._final_output(seq, "abort")

    def abort_all(self) -> list[RequestOutput]:
        return [out for rid in list(self.requests) if (out := self.abort(rid)) is not None]

    # ---- stepping -------------------------------------------------------------------------------------
    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        plan = self.schedule_step()
        if plan is None:
            return []
        try:
            sampled = self.execute(plan)
        except Exception as error:
            self.fail_step(plan, error)
            raise
        return self.finish_step(plan, sampled)

    def schedule_step(self) -> StepPlan | None:
        assert self._plan is None, "the previous step has not finished"
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        batch = StepBatch([self._seq_chunk(c) for c in chunks])
        self._plan = StepPlan(chunks, batch)
        return self._plan

    def execute(self, plan: StepPlan) -> list[SampledToken]:
        return self.runner.run(plan.batch)

    def finish_step(self, plan: StepPlan, sampled: list[SampledToken]) -> list[RequestOutput]:
        self._plan = None
        self.scheduler.on_computed(plan.chunks)
        outputs = []
        sampled_iter = iter(sampled)
        for chunk, seq_chunk in zip(plan.chunks, plan.batch.chunks):
            token = next(sampled_iter) if seq_chunk.sampling is not None else None
            seq = chunk.seq
            if seq.seq_id in self._aborted_in_step:
                self.scheduler.finish(seq, "abort")
                continue
            if token is not None:
                outputs.append(self._append_token(seq, token))
        self._aborted_in_step.clear()
        return outputs

    def fail_step(self, plan: StepPlan, error: BaseException) -> list[RequestOutput]:
        """The forward pass raised: end every request of the step with an error and free its blocks."""
        self._plan = None
        outputs = []
        message = f"{type(error).__name__}: {error}"
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.seq_id in self._aborted_in_step:
                self.scheduler.finish(seq, "abort")
                continue
            self.scheduler.finish(seq, "error")
            self.requests.pop(seq.request_id, None)
            outputs.append(self._final_output(seq, "error", error=message))
        self._aborted_in_step.clear()
        return outputs

    # ---- internals ------------------------------------------------------------------------------------
    def _seq_chunk(self, chunk: ScheduledChunk) -> SeqChunk:
        seq = chunk.seq
        start = seq.num_computed_tokens
        token_ids = seq.token_slice(start, start + chunk.num_tokens)
        sampling = self._sampling_row(seq) if chunk.is_sampling else None
        return SeqChunk(seq.seq_id, token_ids, start, seq.block_table, sampling)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < p.min_tokens:
            banned = tuple(self.eos_token_ids | set(p.stop_token_ids))
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
        )

    def _append_token(self, seq: Sequence, token: SampledToken) -> RequestOutput:
        token_id = token.token_id
        seq.output_token_ids.append(token_id)
        if seq.logprobs is not None:
            seq.logprobs.append(token)
        p = seq.params
        can_stop = seq.num_output_tokens >= p.min_tokens
        text, stop_str = seq.detokenizer.step(token_id, can_stop)
        reason: str | None = None
        if stop_str is not None:
            reason, seq.stop_reason = "stop", stop_str
        elif can_stop and not p.ignore_eos and token_id in self.eos_token_ids:
            reason = "stop"
        elif can_stop and token_id in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token_id
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token_id],
            text_delta=text,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=[token] if seq.logprobs is not None else None,
        )
        if reason is not None:
            if stop_str is None:
                out.text_delta += seq.detokenizer.flush()
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
            out.finished, out.finish_reason, out.stop_reason = True, reason, seq.stop_reason
        return out

    def _final_output(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            text_delta="",
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
        )

    # ---- introspection --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

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
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def __repr__(self) -> str:
        return f"LLMEngine({self.model_name!r}, {self.num_running} running, {self.num_waiting} waiting)"


__all__ = ["LLMEngine", "StepPlan", "SequenceStatus"]
