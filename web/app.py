"""The Quart app: configuration, the shared services, error handlers, routes."""

from __future__ import annotations

from quart import Quart, Response, request

from engine.async_engine import AsyncEngine
from engine.config import ServerConfig
from web.api_keys import install_api_keys
from web.body_limit import BodyLimit
from web.chat_page import blueprint as chat_page
from web.cors import CORS
from web.responses_api.routes import blueprint as responses_api
from web.errors import register_error_handlers
from web.health_answer import HealthAnswer
from web.routes import blueprint
from web.services import Services
from web.tokenizer_routes import blueprint as tokenizer_routes


def create_app(engine: AsyncEngine, config: ServerConfig) -> Quart:
    app = Quart("sluice", static_folder=None)  # the chat page's blueprint serves web/static/
    app.url_map.merge_slashes = False  # "//" would get a redirect built from the client's Host header: a 404 instead
    app.config.update(
        MAX_CONTENT_LENGTH=config.max_body_bytes,
        BODY_TIMEOUT=config.body_timeout,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    app.extensions["sluice"] = services = Services(engine, config)
    app.asgi_app = HealthAnswer(app.asgi_app, engine, services.metrics)  # type: ignore[method-assign]
    app.asgi_app = BodyLimit(app.asgi_app, config.max_body_bytes, config.body_timeout)  # type: ignore[method-assign]
    if config.cors_origin_list:  # outermost: preflights are answered before anything else, every response marked
        app.asgi_app = CORS(app.asgi_app, config.cors_origin_list)  # type: ignore[method-assign]
    register_error_handlers(app)

    @app.after_request
    async def count_response(response: Response) -> Response:  # error handlers' answers pass here too
        if request.path != "/metrics":  # the scrapes themselves, as vLLM's counter leaves them out
            services.metrics.responses.labels(str(response.status_code)).inc()
        return response

    install_api_keys(app, config)
    app.register_blueprint(blueprint)
    app.register_blueprint(responses_api)
    app.register_blueprint(tokenizer_routes)
    app.register_blueprint(chat_page)
    return app
