"""What the routes share: the async engine's public face, the server config and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from quart import current_app

from engine.async_engine import AsyncEngine
from engine.config import ServerConfig
from web.errors import APIError
from web.logprobs import TokenText
from web.metrics import ServerMetrics
from web.tool_calls import ToolFormat, detect_tool_format


@dataclass
class Services:
    engine: AsyncEngine
    config: ServerConfig
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    _token_text: TokenText | None = None
    _tool_format: ToolFormat | None = None

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

    def check_model(self, requested: str) -> str:
        served = self.model_name
        if requested != served:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {served!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return served


def services() -> Services:
    return current_app.extensions["sluice"]
