"""What the routes share: the async engine's public face, the server config and the metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from quart import current_app

from engine.async_engine import AsyncEngine
from engine.config import ServerConfig
from engine.input_processor import PreparedRequest
from engine.reasoning_parser import ReasoningSplitter, marker_token_ids
from web.errors import APIError
from web.logprobs import TokenText
from web.metrics import ServerMetrics
from web.responses_api.store import ResponseStore
from web.tool_calls import ToolFormat, detect_tool_format


@dataclass
class Services:
    engine: AsyncEngine
    config: ServerConfig
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    _token_text: TokenText | None = None
    _tool_format: ToolFormat | None = None
    _marker_tokens: dict[str, int] | None = None
    _thought_marker_tokens: dict[str, int] | None = None
    response_store: ResponseStore = field(init=False)  # /v1/responses kept for GET and previous_response_id
    created: int = field(default_factory=lambda: int(time.time()))  # the model card's: when this server started

    def __post_init__(self) -> None:
        c = self.config
        self.response_store = ResponseStore(c.responses_store_max_count, c.responses_store_max_bytes,
                                            c.responses_store_ttl)  # fmt: skip

    @property
    def model_name(self) -> str:
        """Known once the engine is loaded (unless configured): EngineUnavailable (503) before."""
        return self.config.served_model_name or self.engine.model_name

    @property
    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.engine.tokenizer)
        return self._token_text

    @property
    def tool_format(self) -> ToolFormat:
        """How this model's chat template shows tools and its output writes calls."""
        if self._tool_format is None:
            self._tool_format = detect_tool_format(getattr(self.engine.tokenizer, "chat_template", None))
        return self._tool_format

    @property
    def tool_marker_tokens(self) -> dict[str, int]:
        """The tool format's markers that the tokenizer has as single added tokens, by id."""
        if self._marker_tokens is None:
            added = self.engine.tokenizer.get_added_vocab()
            self._marker_tokens = {m: added[m] for m in self.tool_format.markers if m in added}
        return self._marker_tokens

    def reasoning_splitters(self, prepared: PreparedRequest) -> Callable[[], ReasoningSplitter] | None:
        """With a reasoning parser configured: a maker of one choice's splitter, from where the input processor
        read that the output starts (a template may open the thought, or close it: Qwen 3's enable_thinking false)."""
        syntax = self.engine.reasoning_syntax
        if syntax is None:
            return None
        if self._thought_marker_tokens is None:
            self._thought_marker_tokens = marker_token_ids(self.engine.tokenizer, syntax)
        token_text = self.token_text
        return partial(ReasoningSplitter, syntax, prepared.first_phase,
                       self._thought_marker_tokens.get(syntax.end), lambda token_id: token_text(token_id)[0])  # fmt: skip

    def check_model(self, requested: str | None) -> str:
        """The served model's name. A request may leave its model out (vLLM's rule: one model per server)."""
        served = self.model_name
        if requested is not None and requested != served:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {served!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return served


def services() -> Services:
    return current_app.extensions["sluice"]
