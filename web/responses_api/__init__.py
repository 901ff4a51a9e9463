"""OpenAI's Responses API (/v1/responses): requests, output items and streaming events, the bounded store.

The blueprint is imported from `web.responses_api.routes` (by web/app.py), not re-exported here: web.services
imports the store from this package, and web.routes imports web.services, so an eager import of the routes here
would close a cycle (web.routes -> web.services -> web.responses_api -> its routes -> web.routes).
"""
