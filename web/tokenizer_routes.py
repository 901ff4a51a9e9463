"""/tokenize, /detokenize and /tokenizer_info, as vLLM serves them: what evaluation tools (lm-evaluation-harness's
`local-completions` with `tokenizer_backend=remote`) use to count and cut prompts with the served tokenizer."""

from __future__ import annotations

from typing import TypeVar

from quart import Blueprint, Response

from web.json_response import json_response
from web.routes import parse_json, receive_body
from web.schemas import DetokenizeRequest, TokenizeRequest, parse_request
from web.services import Services, services
from web.tool_calls import plan_tools

blueprint = Blueprint("tokenizer", __name__)
Body = TypeVar("Body", TokenizeRequest, DetokenizeRequest)


async def tokenizer_request(s: Services, model: type[Body]) -> Body:
    """The parsed body; `model` is optional, as everywhere, but checked when given."""
    data, _ = await receive_body(s)
    body = parse_request(model, parse_json(data))
    s.check_model(body.model)
    return body


@blueprint.post("/tokenize")
async def tokenize() -> Response:
    s = services()
    body = await tokenizer_request(s, TokenizeRequest)
    if body.messages is not None:  # as a chat request renders them, its tools (tool_choice "auto") included
        tools = body.function_tools()
        messages = [m.as_template_dict() for m in body.messages]
        plan = plan_tools(s.tool_format, messages, tools, "auto" if tools else "none", None, True, s.tool_marker_tokens)
        tokens = await s.engine.encode_chat(plan.messages, **plan.template_kwargs, **body.template_options())
    else:
        add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await s.engine.encode_text(body.prompt or "", add_special_tokens=add_special_tokens)
    result = {"count": len(tokens), "max_model_len": s.engine.max_model_len, "tokens": tokens}
    if body.return_token_strs:
        result["token_strs"] = s.engine.tokenizer.convert_ids_to_tokens(tokens)
    return json_response(result)


@blueprint.post("/detokenize")
async def detokenize() -> Response:
    s = services()
    body = await tokenizer_request(s, DetokenizeRequest)
    return json_response({"prompt": await s.engine.decode(body.tokens)})


@blueprint.get("/tokenizer_info")
async def tokenizer_info() -> Response:
    s = services()
    tokenizer = s.engine.tokenizer
    return json_response(
        {
            "tokenizer_class": type(tokenizer).__name__,
            "model_max_length": s.engine.max_model_len,
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "chat_template": tokenizer.chat_template,
        }
    )
