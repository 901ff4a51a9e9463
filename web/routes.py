"""The HTTP endpoints. Handlers parse and hand over: the async engine prepares (off the loop), admits and
streams; nothing here touches the engine's core."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

import anyio
import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from quart import Blueprint, Response, current_app, request

from engine.async_engine import QueueFull, Reservation
from engine.input_processor import PreparedRequest
from engine.outputs import ChoiceOutput, FinishReason
from engine.request import OutputStream
from web.errors import APIError, failure_of
from web.health_answer import health_answer
from web.json_response import json_response
from web.metrics import RequestTimer
from web.responses import ChatResponses, CompletionResponses, EchoedPrompt, ResponseFormat
from web.schemas import ChatCompletionRequest, CompletionRequest, named_as_sent, parse_request
from web.services import Services, services
from web.sse import event_stream_response, sse_response, stream_batch_events
from web.tool_calls import plan_tools

blueprint = Blueprint("openai", __name__)


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    s = services()
    data, entry = await receive_body(s)
    body = parse_request(ChatCompletionRequest, parse_json(data))
    params = body.to_sampling_params()
    fmt = ChatResponses(s.check_model(body.model), s.token_text, bool(body.logprobs), body.include_usage,
                        body.continuous_usage)
    choice, function_name = body.tool_choice_kind()
    messages = [m.as_template_dict() for m in body.messages]
    plan = plan_tools(s.tool_format, messages, body.function_tools(), choice, function_name,
                      body.parallel_tool_calls is not False, s.tool_marker_tokens, params.structured_outputs)  # fmt: skip
    if plan.structured_outputs is not None:
        params = replace(params, structured_outputs=plan.structured_outputs)
    if plan.syntax is not None:
        fmt.read_tool_calls(plan.syntax)
    check_num_sequences(s, 1, params.n)
    with admit(s, entry, 1, params.n) as reservation:
        with named_as_sent(body.wire_names()), plan.errors_named():
            template_kwargs = {**plan.template_kwargs, **body.template_options()}
            prepared = await s.engine.prepare_chat(fmt.id, plan.messages, params, **template_kwargs)
        fmt.read_reasoning(s.reasoning_splitters(prepared))
        return await generate(s, reservation, fmt, prepared, bool(body.stream))


@blueprint.post("/v1/completions")
async def completions() -> Response:
    s = services()
    data, entry = await receive_body(s)
    body = parse_request(CompletionRequest, parse_json(data))
    params = body.to_sampling_params()
    fmt = CompletionResponses(s.check_model(body.model), s.token_text, body.logprobs is not None, body.include_usage,
                              body.continuous_usage)
    prompts = body.prompts()
    check_num_sequences(s, len(prompts), params.n)
    with admit(s, entry, len(prompts), params.n) as reservation:
        if len(prompts) == 1 and not body.echo:
            with named_as_sent(body.wire_names()):
                prepared = await s.engine.prepare_prompt(fmt.id, prompts[0], params)
            return await generate(s, reservation, fmt, prepared, bool(body.stream))
        with named_as_sent(body.wire_names()):
            batch = [await s.engine.prepare_prompt(f"{fmt.id}-{i}", p, params) for i, p in enumerate(prompts)]
        if body.stream:
            streams = [reservation.generate(prepared) for prepared in batch]
            timers = [RequestTimer(s.metrics, stream.request) for stream in streams]
            return event_stream_response(stream_batch_events(streams, fmt, timers))
        echoes = None
        if body.echo:
            texts = [p if isinstance(p, str) else await s.engine.decode(p) for p in prompts]
            added = s.token_text.num_added_to_text  # in the token ids of a text prompt, not in its text
            echoes = [EchoedPrompt(text, r.prompt_token_ids, *(added if isinstance(p, str) else (0, 0)))
                      for text, r, p in zip(texts, batch, prompts)]  # fmt: skip
        results = await generate_batch(s, reservation, batch)
    return json_response(fmt.batch_response(results, echoes))


@blueprint.get("/v1/models")
async def models() -> Response:
    return json_response({"object": "list", "data": [model_card(services())]})


@blueprint.get("/v1/models/<path:model_id>")
async def model(model_id: str) -> Response:
    s = services()
    return json_response(model_card(s, s.check_model(model_id)))


def model_card(s: Services, model_id: str | None = None) -> dict[str, Any]:
    """OpenAI's fields, and vLLM's max_model_len (what clients size prompts by), root and parent."""
    name = model_id or s.model_name
    return {"id": name, "object": "model", "created": s.created, "owned_by": "sluice", "root": s.model_name,
            "parent": None, "max_model_len": s.engine.max_model_len}  # fmt: skip


@blueprint.get("/health")
async def health() -> Response:
    """Answered before Quart by web/health_answer.py (GET and HEAD); here for its other methods' 405."""
    body, status = health_answer(services().engine)
    return json_response(body, status)


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
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":  # its bytes would be taken for JSON and fail as text that is not UTF-8
        raise APIError(415, f"the request body's content-encoding {encoding!r} is not supported: send it uncompressed",
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
        why = str(error)
        try:  # orjson names any bytes that are not UTF-8 as "surrogates not allowed"
            data.decode("utf-8")
        except UnicodeDecodeError as bad:
            why = f"it is not UTF-8 (byte {bad.start:,} is {data[bad.start]:#04x})"
        raise APIError(400, f"the request body is not valid JSON: {why}", code="invalid_json") from None


async def generate(
    s: Services, reservation: Reservation, fmt: ResponseFormat, prepared: PreparedRequest, streaming: bool
) -> Response:
    outputs = reservation.generate(prepared)
    timer = RequestTimer(s.metrics, outputs.request)
    if streaming:
        return sse_response(outputs, fmt, timer)
    results = await collect(outputs, timer)
    check_finished(results)
    return json_response(fmt.full_response(results))


async def generate_batch(
    s: Services, reservation: Reservation, batch: list[PreparedRequest]
) -> list[list[ChoiceOutput]]:
    """Every prompt of one request runs at once, queued all or none; a failed one fails the request (after the
    rest ended). Each prompt's n choices, prompt by prompt."""
    async with AsyncExitStack() as stack:  # closing a stream aborts its request if unfinished
        streams = [await stack.enter_async_context(reservation.generate(prepared)) for prepared in batch]
        results: list[list[ChoiceOutput]] = [[] for _ in streams]

        async def collect_into(i: int) -> None:
            results[i] = await collect(streams[i], RequestTimer(s.metrics, streams[i].request))

        async with anyio.create_task_group() as tg:
            for i in range(len(streams)):
                tg.start_soon(collect_into, i)
    for choices in results:
        check_finished(choices)
    return results


def check_num_sequences(s: Services, num_prompts: int, n: int) -> None:
    """One request runs no more sequences than the admission queue holds requests: a list of prompts times n would
    otherwise let one client put thousands of sequences ahead of everyone else (chat and completions alike)."""
    if num_prompts * n > s.config.max_pending:
        what = " x ".join(([f"{num_prompts} prompts"] if num_prompts > 1 else []) + ([f"n = {n}"] if n > 1 else []))
        raise APIError(400, f"{what}: at most max_pending ({s.config.max_pending}) sequences per request",
                       param="n" if n > 1 else "prompt")  # fmt: skip


def admit(s: Services, entry: float, num_requests: int, num_choices: int = 1) -> Reservation:
    """The admission decision, before any tokenizing: slots held for the request's prompts (n choices each), or a
    429 now."""
    try:
        reservation = s.engine.reserve(num_requests, num_choices)
    except QueueFull as error:
        s.metrics.admission.observe(time.perf_counter() - entry)
        s.metrics.rejected.inc()
        retry_after = {"Retry-After": str(s.config.retry_after_seconds)}
        raise APIError(429, f"the server is busy: {error}", code="queue_full", headers=retry_after) from None
    s.metrics.admission.observe(time.perf_counter() - entry)
    return reservation


async def collect(outputs: OutputStream, timer: RequestTimer) -> list[ChoiceOutput]:
    """The request's choices, whole, in index order."""
    results = [ChoiceOutput(i, outputs.request_id) for i in range(outputs.request.num_choices)]
    try:
        async with outputs:
            async for output in outputs:
                timer.observe(output)
                results[output.index].absorb(output)
    finally:
        if not timer.ended:  # the client left (the handler was cancelled)
            timer.end(FinishReason.ABORT)
    return results


def check_finished(results: list[ChoiceOutput]) -> None:
    for result in results:
        if result.finish_reason is None or result.finish_reason is FinishReason.ERROR:
            raise failure_of(result)
