"""OpenAI's Responses API (/v1/responses): requests, output items and streaming events, the bounded store."""

from web.responses_api.routes import blueprint

__all__ = ["blueprint"]
