"""A completion stream of several prompts whose client stops reading is bounded as a one-prompt stream is: each
prompt's unread output is merged in its request (not queued delta by delta in the handler), so the engine's
watchdog sees it unread and aborts it after client_read_timeout."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from web.logprobs import TokenText
from web.metrics import RequestTimer, ServerMetrics
from web.responses import CompletionResponses
from web.sse import stream_batch_events

from tests.support.engine_helpers import slow_steps
from tests.support.server_harness import tiny_engine_config

pytestmark = pytest.mark.anyio
MAX_TOKENS = 400


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_stream_of_several_prompts_left_unread_is_aborted_after_the_read_timeout(tiny_llama_dir) -> None:
    engine = LLMEngine(tiny_engine_config(tiny_llama_dir))
    slow_steps(engine, 0.01)
    async_engine = AsyncEngine(lambda: engine, max_pending=8, client_read_timeout=0.5)
    async with anyio.create_task_group() as tg:
        await tg.start(async_engine.run)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        streams = [
            async_engine.generate(engine.input_processor.process_prompt(f"p{i}", f"Hello {i}", params))
            for i in range(2)
        ]
        fmt = CompletionResponses("tiny", TokenText(engine.tokenizer), False, False)
        timers = [RequestTimer(ServerMetrics(), stream.request) for stream in streams]
        events = stream_batch_events(streams, fmt, timers)
        # The client reads the first event in a task of its own (the one a read timeout cancels), then no more.
        await asyncio.create_task(events.__anext__())
        with anyio.fail_after(30):
            while engine.has_unfinished_requests or not all(s.request.is_finished for s in streams):
                await anyio.sleep(0.01)
        for stream in streams:
            assert stream.request.finish_reasons == [FinishReason.ABORT]
            assert stream.request.num_output_tokens < MAX_TOKENS
        await events.aclose()
        assert engine.num_free_blocks == engine.num_total_blocks
        await async_engine.drain(timeout=5)
