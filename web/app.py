"""The Quart app: configuration, the services the routes share, error handlers, routes."""

from __future__ import annotations

from dataclasses import dataclass, field

from quart import Quart, current_app

from engine.async_engine import AsyncEngine, EngineUnavailable
from engine.config import ServerConfig
from web.errors import APIError, register_error_handlers
from web.logprobs import TokenText
from web.metrics import ServerMetrics


@dataclass
class Services:
    engine: AsyncEngine
    config: ServerConfig
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    _token_text: TokenText | None = None

    @property
    def model_name(self) -> str:
        """Known once the engine is loaded (unless configured): 503 before."""
        if self.config.served_model_name:
            return self.config.served_model_name
        try:
            return self.engine.engine.model_name
        except EngineUnavailable as error:
            raise APIError(503, f"the model is not available: {error}", code=f"engine_{error.state.value}") from None

    @property
    def token_text(self) -> TokenText:
        if self._token_text is None:
            self._token_text = TokenText(self.engine.engine.tokenizer)
        return self._token_text

    def check_model(self, requested: str) -> str:
        served = self.model_name
        if requested != served:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves {served!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return served


def services() -> Services:
    return current_app.extensions["sluice"]


def create_app(engine: AsyncEngine, config: ServerConfig) -> Quart:
    from web.routes import blueprint

    app = Quart("sluice")
    app.config.update(
        MAX_CONTENT_LENGTH=config.max_body_bytes,
        BODY_TIMEOUT=config.body_timeout,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    app.extensions["sluice"] = Services(engine, config)
    register_error_handlers(app)
    app.register_blueprint(blueprint)
    return app
