"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, POST
/v1/responses/{id}/cancel (refused, as OpenAI refuses it for a response not made in the background): the Responses API
on the chat path's engine, admission, tool calls and structured outputs. A request becomes chat messages (its
previous response's conversation, then its input), runs as one chat request, and is told as a response
(web/responses_api/output.py)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import orjson
from quart import Blueprint, Response, request

from engine.errors import InvalidRequest
from engine.outputs import FinishReason
from web.api_keys import bearer_token
from web.errors import APIError, failure_of
from web.json_response import json_response
from web.metrics import RequestTimer
from web.responses import Usage
from web.responses_api.conversation import Item, chat_messages, listed_input_items, output_items_as_input, with_ids
from web.responses_api.output import ResponseBuilder, new_id, usage_object
from web.responses_api.request import ResponsesRequest, parse_responses_request
from web.responses_api.store import ResponseStore
from web.responses_api.stream import response_events
from web.routes import admit, collect, parse_json, receive_body
from web.schemas import named_as_sent
from web.services import Services, services
from web.sse import event_stream_response
from web.tool_calls import plan_tools

logger = logging.getLogger(__name__)
blueprint = Blueprint("responses_api", __name__)


@blueprint.post("/v1/responses")
async def create_response() -> Response:
    s = services()
    data, entry = await receive_body(s)
    body = parse_responses_request(parse_json(data))
    settings = echoed_settings(body, s.check_model(body.model))
    owner = key_owner(s)
    items = previous_conversation(s.response_store, body.previous_response_id, owner) + body.input_items()
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    params = body.to_sampling_params()
    choice, function_name = body.tool_choice_kind()
    plan = plan_tools(s.tool_format, chat_messages(body.instructions, items), body.function_tools(), choice,
                      function_name, bool(body.parallel_tool_calls), s.tool_marker_tokens,
                      params.structured_outputs)  # fmt: skip
    if plan.structured_outputs is not None:
        params = replace(params, structured_outputs=plan.structured_outputs)
    builder = ResponseBuilder(new_id("resp"), settings, plan.syntax)

    def keep(finished: ResponseBuilder) -> None:
        if body.store:
            store_response(s.response_store, finished, owner, items)

    with admit(s, entry, 1) as reservation:
        try:
            with named_as_sent(body.wire_names()), plan.errors_named():
                prepared = await s.engine.prepare_chat(builder.id, plan.messages, params, **plan.template_kwargs)
        except InvalidRequest as error:  # the input processor names the chat path's parameter, "messages"
            if error.param != "messages":
                raise
            message = error.message.replace("the messages have", "the input has").replace("the messages", "the input")
            raise APIError(400, message, param="input", code=error.code) from None
        builder.read_reasoning(s.reasoning_splitters(prepared))
        outputs = reservation.generate(prepared)
    timer = RequestTimer(s.metrics, outputs.request)
    progress: AbstractContextManager[None] = (
        shown_in_progress(s.response_store, builder, owner, items) if body.store else nullcontext()
    )
    if body.stream:
        return event_stream_response(response_events(outputs, builder, timer, keep, progress))
    with progress:
        (result,) = await collect(outputs, timer)
        builder.feed(result.text, result.token_ids)
        usage = Usage.of_choices([result])
        builder.finish(result.finish_reason, result.error,
                       usage_object(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                                    builder.num_reasoning_tokens), result.error_code)  # fmt: skip
        keep(builder)
    if result.finish_reason is None or result.finish_reason is FinishReason.ERROR:
        raise failure_of(result)
    return json_response(builder.response())


@blueprint.get("/v1/responses/<response_id>")
async def get_response(response_id: str) -> Response:
    s = services()
    if request.args.get("stream", "false").lower() not in ("false", "0"):
        raise APIError(400, "streaming a stored response again is not supported", param="stream")
    owner = key_owner(s)
    stored = s.response_store.get(response_id, owner)
    if stored is not None:
        return Response(stored.body, status=200, content_type="application/json")
    in_progress = s.response_store.in_progress(response_id, owner)
    if in_progress is None:
        raise not_found(response_id)
    return Response(in_progress.body(), status=200, content_type="application/json")


@blueprint.get("/v1/responses/<response_id>/input_items")
async def list_input_items(response_id: str) -> Response:
    """OpenAI's list: `limit` (1-100, default 20), `order` ("desc", the default, or "asc"), `after` (an item id)."""
    s = services()
    owner = key_owner(s)
    stored, in_progress = s.response_store.get(response_id, owner), s.response_store.in_progress(response_id, owner)
    if stored is not None:
        items = listed_input_items(orjson.loads(stored.conversation)[: stored.num_input_items])
    elif in_progress is not None:
        items = listed_input_items(orjson.loads(in_progress.conversation))
    else:
        raise not_found(response_id)
    limit, order, after = request.args.get("limit", "20"), request.args.get("order", "desc"), request.args.get("after")
    if not limit.isdecimal() or not 1 <= int(limit) <= 100:
        raise APIError(400, "limit must be an integer from 1 to 100", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be 'asc' or 'desc'", param="order")
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"after names no input item of response {response_id!r}", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit)]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})  # fmt: skip


@blueprint.delete("/v1/responses/<response_id>")
async def delete_response(response_id: str) -> Response:
    s = services()
    owner = key_owner(s)
    if s.response_store.in_progress(response_id, owner) is not None:
        raise APIError(400, f"Response with id {response_id!r} is still in progress: delete it once it has finished")
    if not s.response_store.delete(response_id, owner):
        raise not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


@blueprint.post("/v1/responses/<response_id>/cancel")
async def cancel_response(response_id: str) -> Response:
    """OpenAI cancels only responses made with background: true, which this server refuses to make: a response
    in progress here stops when its client closes the connection."""
    s = services()
    owner = key_owner(s)
    if s.response_store.get(response_id, owner) is None and s.response_store.in_progress(response_id, owner) is None:
        raise not_found(response_id)
    raise APIError(400, "only responses created with background: true can be cancelled, and this server makes "
                   "none: a streamed response stops when its client closes the connection")  # fmt: skip


def not_found(response_id: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", param=param, code=code)


def key_owner(s: Services) -> bytes | None:
    """Who may see a stored response: the digest of the request's API key (None on a server without keys)."""
    if not s.config.api_keys:
        return None
    token = bearer_token(request.headers.get("Authorization")) or ""
    return hashlib.sha256(token.encode()).digest()


def previous_conversation(store: ResponseStore, response_id: str | None, owner: bytes | None) -> list[Item]:
    if response_id is None:
        return []
    stored = store.get(response_id, owner)
    if stored is not None:
        return orjson.loads(stored.conversation)
    if store.in_progress(response_id, owner) is not None:
        raise APIError(400, f"Response with id {response_id!r} is still in progress: continue from it once it has "
                       "finished", param="previous_response_id", code="previous_response_in_progress")  # fmt: skip
    raise not_found(response_id, param="previous_response_id", code="previous_response_not_found")


@contextmanager
def shown_in_progress(store: ResponseStore, builder: ResponseBuilder, owner: bytes | None,
                      items: list[Item]) -> Iterator[None]:  # fmt: skip
    """While the response is made, GET, input_items and previous_response_id find it in progress."""
    if store.max_count == 0:
        yield
        return
    store.begin(builder.id, owner, lambda: orjson.dumps(builder.response()), orjson.dumps(with_ids(builder.id, items)))
    try:
        yield
    finally:
        store.end(builder.id)


def store_response(store: ResponseStore, builder: ResponseBuilder, owner: bytes | None, items: list[Item]) -> None:
    if store.max_count == 0:  # responses_store_max_count = 0: the server keeps none, by choice
        return
    conversation = orjson.dumps(with_ids(builder.id, items) + output_items_as_input(builder.output))
    if not store.put(builder.id, owner, orjson.dumps(builder.response()), conversation, len(items)):
        logger.warning("response %s is larger than the whole response store (%d bytes): not stored",
                       builder.id, store.max_bytes)  # fmt: skip


def echoed_settings(body: ResponsesRequest, model: str) -> dict[str, Any]:
    """What the response object repeats of its request."""
    fmt = body.text_format()
    text_format: dict[str, Any] = {"type": "text"}
    if fmt is not None and fmt.type == "json_schema":
        text_format = {"type": "json_schema", "name": fmt.name or "response", "schema": fmt.schema_,
                       "description": fmt.description, "strict": bool(fmt.strict)}  # fmt: skip
    elif fmt is not None:
        text_format = {"type": fmt.type}
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
              "strict": t.strict if t.strict is not None else True} for t in body.function_tools_specs()]  # fmt: skip
    return {
        "model": model,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": bool(body.parallel_tool_calls),
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": bool(body.store),
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": text_format},
        "tool_choice": body.tool_choice_echo(),
        "tools": tools,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "user": body.user,
    }
