"""The Quart app: configuration, the shared services, error handlers, routes."""

from __future__ import annotations

from quart import Quart

from engine.async_engine import AsyncEngine
from engine.config import ServerConfig
from web.body_limit import BodyLimit
from web.errors import register_error_handlers
from web.routes import blueprint
from web.services import Services


def create_app(engine: AsyncEngine, config: ServerConfig) -> Quart:
    app = Quart("sluice")
    app.config.update(
        MAX_CONTENT_LENGTH=config.max_body_bytes,
        BODY_TIMEOUT=config.body_timeout,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    app.asgi_app = BodyLimit(app.asgi_app, config.max_body_bytes, config.body_timeout)  # type: ignore[method-assign]
    app.extensions["sluice"] = Services(engine, config)
    register_error_handlers(app)
    app.register_blueprint(blueprint)
    return app
