"""The generation worker's app: the common routes and every protocol's, over one
``Worker`` (the protocols are formatters over its one pipeline)."""

from __future__ import annotations

import asyncio

from quart import Quart, g

from .anthropic import register_anthropic
from .app import Worker, common_routes
from .engine import Engine
from .ollama import register_ollama
from .openai_api import register_openai
from .responses import register_responses


def create_app(engine: Engine) -> Quart:
    """Build the Quart app serving ``engine`` over the OpenAI, Anthropic, Responses and
    Ollama APIs."""
    app = Quart("mlxfleet.worker")
    worker = Worker(engine)
    common_routes(app, worker.name, "generate", engine, worker.status)
    register_openai(app, worker)
    register_anthropic(app, worker)
    register_ollama(app, worker)
    register_responses(app, worker)

    @app.after_request
    async def _reply_headers(response):
        """Notices about how a request was served (a lowered max_tokens, left-out
        tools, ...)."""
        for k, v in getattr(g, "reply_headers", {}).items():
            response.headers[k] = v
        return response

    @app.before_serving
    async def _warm():
        app.warming = asyncio.get_running_loop().create_task(worker.warm())

    return app
