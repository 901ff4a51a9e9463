"""The HTTP endpoints. Handlers parse and hand over: the async engine prepares (off the loop), admits and
streams; nothing here touches the engine's core."""

from __future__ import annotations

import time
from typing import Any

import anyio
import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Blueprint, Response, current_app, request

from engine.async_engine import EngineState, QueueFull
from engine.input_processor import PreparedRequest
from engine.outputs import FinishReason
from engine.request_stream import RequestStream
from web.errors import APIError
from web.json_response import json_response
from web.metrics import RequestTimer
from web.responses import ChatResponses, Completion, CompletionResponses, ResponseFormat, Usage
from web.schemas import ChatCompletionRequest, CompletionRequest, parse_request
from web.services import Services, services
from web.sse import sse_response

blueprint = Blueprint("openai", __name__)


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    s = services()
    data, entry = await receive_body(s)
    body = parse_request(ChatCompletionRequest, parse_json(data))
    fmt = ChatResponses(s.check_model(body.model), s.token_text, bool(body.logprobs), body.include_usage)
    messages = [m.as_template_dict() for m in body.messages]
    prepared = await s.engine.prepare_chat(fmt.id, messages, body.to_sampling_params())
    return await generate(s, entry, fmt, prepared, bool(body.stream))


@blueprint.post("/v1/completions")
async def completions() -> Response:
    s = services()
    data, entry = await receive_body(s)
    body = parse_request(CompletionRequest, parse_json(data))
    fmt = CompletionResponses(s.check_model(body.model), s.token_text, body.logprobs is not None, body.include_usage)
    prepared = await s.engine.prepare_prompt(fmt.id, body.single_prompt(), body.to_sampling_params())
    return await generate(s, entry, fmt, prepared, bool(body.stream))


@blueprint.get("/v1/models")
async def models() -> Response:
    s = services()
    model = {"id": s.model_name, "object": "model", "created": 0, "owned_by": "sluice"}
    return json_response({"object": "list", "data": [model]})


@blueprint.get("/health")
async def health() -> Response:
    stats = services().engine.stats()
    return json_response(
        {
            "state": stats.state,
            "waiting": stats.waiting,
            "running": stats.running,
            "pending": stats.pending,
            "free_kv_blocks": stats.free_kv_blocks,
            "total_kv_blocks": stats.total_kv_blocks,
        },
        200 if stats.state == EngineState.READY.value else 503,
    )


@blueprint.get("/metrics")
async def metrics() -> Response:
    s = services()
    return Response(s.metrics.render(s.engine.stats()), content_type=CONTENT_TYPE_LATEST)


async def receive_body(s: Services) -> tuple[bytes, float]:
    """The whole body (network I/O, measured apart) and the start of admission."""
    handler_entry = time.perf_counter()
    if request.mimetype != "application/json":
        raise APIError(415, f"the request body must be application/json, not {request.mimetype or 'absent'!r}",
                       code="unsupported_media_type")  # fmt: skip
    # Awaiting the body itself does not yield when it has already arrived, unlike request.get_data(),
    # whose asyncio.wait_for always does.
    try:
        with anyio.fail_after(current_app.config["BODY_TIMEOUT"]):
            data = await request.body
    except TimeoutError:
        raise APIError(408, "the request body did not arrive in time", code="request_timeout") from None
    admission_start = time.perf_counter()
    s.metrics.body_wait.observe(admission_start - handler_entry)
    return data, admission_start


def parse_json(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise APIError(400, f"the request body is not valid JSON: {error}", code="invalid_json") from None


async def generate(s: Services, entry: float, fmt: ResponseFormat, prepared: PreparedRequest, streaming: bool) -> Response:
    try:
        stream = s.engine.submit(prepared)
    except QueueFull as error:
        s.metrics.admission.observe(time.perf_counter() - entry)
        s.metrics.rejected.inc()
        retry_after = {"Retry-After": str(s.config.retry_after_seconds)}
        raise APIError(429, f"the server is busy: {error}", code="queue_full", headers=retry_after) from None
    s.metrics.admission.observe(time.perf_counter() - entry)
    timer = RequestTimer(s.metrics, stream)
    if streaming:
        return sse_response(stream, fmt, timer, s.engine.abort)
    return json_response(fmt.full_response(await collect(s, stream, timer)))


async def collect(s: Services, stream: RequestStream, timer: RequestTimer) -> Completion:
    result = Completion(Usage(prompt_tokens=stream.num_prompt_tokens))
    try:
        async for output in stream:
            timer.observe(output)
            result.absorb(output)
    finally:
        stream.close()
        s.engine.abort(stream.request_id)
        if not timer.ended:  # the client left (the handler was cancelled)
            timer.end(FinishReason.ABORT)
    if result.finish_reason is None or result.finish_reason is FinishReason.ERROR:
        raise APIError(500, result.error or "the request ended without a result", code="engine_error")
    return result
