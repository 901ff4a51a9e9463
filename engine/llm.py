"""The offline API: LLM(model).generate(prompts, params) and LLM.chat(messages, params)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from engine.config import engine_config
from engine.errors import InvalidRequest
from engine.input_processor import as_token_list, chat_template_options, is_token_id
from engine.llm_engine import LLMEngine
from engine.outputs import ChoiceOutput, CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """LLM(model=None, **overrides): None is config.toml's model ("" there: the default SmolLM2 GGUF);
    overrides take config.toml's [engine] keys (dtype, num_kv_blocks, max_num_seqs, ...)."""

    def __init__(self, model: str | None = None, **overrides: Any) -> None:
        if model is not None:
            overrides["model"] = model
        self.engine = LLMEngine(engine_config(**overrides))
        self.tokenizer = self.engine.tokenizer
        self._request_ids = itertools.count()
        # Calls from several threads, or several open streams, share the engine: one steps it at a time, and each
        # step's deltas go to the inbox of the call that added their request.
        self._lock = threading.Lock()
        self._inboxes: dict[str, list[RequestOutput]] = {}  # request id -> its call's inbox

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Generate for each prompt (a string or a list of token ids); results in the order given, each with
        its SamplingParams.n choices in `outputs`. The arguments are named as vLLM's."""
        prompts = as_token_list(prompts)  # a numpy array or torch tensor: one prompt (1-D) or a batch (2-D)
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and is_token_id(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequest(f"prompts must be a string, a list of token ids or a list of those, not "
                                 f"{type(prompts).__name__}", param="prompt")  # fmt: skip
        token_lists = [self.engine.input_processor.encode_prompt(p) for p in prompts]
        return self._run(token_lists, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[CompletionOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate. As vLLM's:
        continue_final_message leaves the last message open for the model to go on (no generation prompt);
        chat_template_kwargs are more variables for the template (Qwen 3's enable_thinking, say)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = chat_template_options(add_generation_prompt, continue_final_message, chat_template_kwargs)
        token_lists = [self.engine.input_processor.encode_chat(list(c), **options) for c in conversations]
        return self._run(token_lists, sampling_params, use_tqdm, is_chat=True)

    def stream(
        self,
        prompt: Prompt | list[Message],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Iterator[RequestOutput]:
        """One request's deltas as the engine makes them (with n > 1, each carries its choice's index); the
        prompt is text, token ids, or a conversation (through the chat template, with chat's options). Closing
        the iterator early aborts the request."""
        processor = self.engine.input_processor
        is_chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
        if is_chat:
            options = chat_template_options(add_generation_prompt, continue_final_message, chat_template_kwargs)
            token_ids = processor.encode_chat(prompt, **options)
        else:
            token_ids = processor.encode_prompt(prompt)  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        inbox: list[RequestOutput] = []
        request_id = self._add(token_ids, params, inbox, is_chat)
        num_open = params.n
        try:
            while num_open:
                deltas = self._next_deltas(inbox)
                if not deltas:
                    return
                for delta in deltas:
                    yield delta
                    num_open -= delta.finished
        finally:
            self._abort(request_id)

    def _run(
        self,
        token_lists: list[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None,
        use_tqdm: bool,
        is_chat: bool = False,
    ) -> list[CompletionOutput]:
        if params is None:
            params = SamplingParams()
        params_list = [params] * len(token_lists) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(token_lists):
            raise ValueError(f"got {len(params_list)} sampling params for {len(token_lists)} prompts")
        results: dict[str, CompletionOutput] = {}
        inbox: list[RequestOutput] = []
        try:
            for token_ids, p in zip(token_lists, params_list):
                request_id = self._add(token_ids, p, inbox, is_chat)
                results[request_id] = CompletionOutput(request_id, token_ids, [ChoiceOutput(i) for i in range(p.n)])
            with tqdm(total=len(results), desc="generate", disable=not use_tqdm, unit="req") as bar:
                num_pending = len(results)
                while num_pending:
                    deltas = self._next_deltas(inbox)
                    if not deltas:
                        break
                    for delta in deltas:
                        result = results[delta.request_id]
                        result.absorb(delta)
                        if delta.finished and result.is_finished:
                            num_pending -= 1
                            bar.update(1)
        finally:
            for request_id in results:  # on an error (or KeyboardInterrupt), leave nothing behind
                self._abort(request_id)
        return list(results.values())

    def _add(self, token_ids: list[int], params: SamplingParams, inbox: list[RequestOutput], is_chat: bool) -> str:
        request_id = f"offline-{next(self._request_ids)}"
        with self._lock:
            self.engine.add_request(request_id, token_ids, params, is_chat)
            self._inboxes[request_id] = inbox
        return request_id

    def _next_deltas(self, inbox: list[RequestOutput]) -> list[RequestOutput]:
        """The call's next deltas, stepping the engine (for every request in it) until some reach its inbox; []
        when the engine has nothing left to run."""
        with self._lock:
            while not inbox and self.engine.has_unfinished_requests:
                # a failed forward pass raises here, its requests' error deltas delivered first: another call's
                # stream ends with its error, not silently
                self._deliver(self.engine.step(on_failed=self._deliver))
            deltas = inbox[:]
            inbox.clear()
            return deltas

    def _deliver(self, deltas: list[RequestOutput]) -> None:
        for delta in deltas:
            target = self._inboxes.get(delta.request_id)
            if target is not None:  # None: a request added through self.engine, not by this LLM
                target.append(delta)

    def _abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort(request_id)
            self._inboxes.pop(request_id, None)
