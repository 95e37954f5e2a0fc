"""The gateway's ASGI app: routes, error rendering per dialect, the model-list refresher."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from flotilla.gateway import anthropic_api, batch_api, health, models_api, openai_api, openapi
from flotilla.gateway.connection_limits import StreamSlots
from flotilla.gateway.batch_jobs import routes as batch_job_routes
from flotilla.gateway.batch_jobs.service import BatchJobs
from flotilla.gateway.batch_jobs.store import BatchStore
from flotilla.gateway.context import GatewayContext, RequestContextMiddleware
from flotilla.gateway.dialects import dialect_for_path, error_response, http_error
from flotilla.gateway.queue_load import queue_load_signal
from flotilla.tenancy.keys import KeyStore
from flotilla.gateway.metrics import GatewayMetrics
from flotilla.gateway.model_registry import ModelRegistry, TokenizerBuilder, build_engine_tokenizer
from flotilla.gateway.router_client import RouterBackend
from flotilla.gateway.safety import moderations_api
from flotilla.gateway.safety.config import SafetyConfig
from flotilla.gateway.settings import GatewaySettings
from flotilla.tenancy.gatekeeper import Gatekeeper
from flotilla.tenancy.local_quota import LocalQuotaStore
from flotilla.usage.ledger import UsageLedger


def create_app(settings: GatewaySettings, backend: RouterBackend, key_store: KeyStore | None,
               tokenizer_builder: TokenizerBuilder = build_engine_tokenizer,
               metrics: GatewayMetrics | None = None, gatekeeper: Gatekeeper | None = None,
               ledger: UsageLedger | None = None, batch_store: BatchStore | None = None,
               safety: SafetyConfig | None = None) -> FastAPI:
    """The app does not own `backend`, `gatekeeper` or `ledger`: whoever made them closes them after the server
    stops. Without a gatekeeper, `key_store` (in memory, in-process quotas) authenticates; neither: no auth.
    With a ledger, every request that reaches the router leaves a usage record. Batch jobs live in `batch_store`
    (Redis; the caller's to close), else in SQLite at settings.batch.state_file. `safety` (its classifier
    clients closed with the app) screens prompts and answers; by default settings.safety_config's file."""
    metrics = metrics or GatewayMetrics()
    registry = ModelRegistry(backend, tokenizer_builder, settings.min_refresh_gap_s)
    if gatekeeper is None and key_store is not None:
        gatekeeper = Gatekeeper(key_store.as_async(), LocalQuotaStore())
    if safety is None and settings.safety_config is not None:
        safety = SafetyConfig.load(settings.safety_config)
    context = GatewayContext(settings, backend, registry, key_store, metrics, gatekeeper, ledger,
                             StreamSlots(settings.max_streams_per_key, settings.retry_after_s), safety,
                             queue_load_signal(settings, backend))
    batch_jobs = BatchJobs.create(settings.batch, batch_store, metrics.registry, ledger)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        background = [asyncio.create_task(registry.refresh_forever(settings.model_refresh_s))]
        if context.queue_load is not None:  # the router's queue wait, for degradation
            background.append(asyncio.create_task(context.queue_load.run_forever()))
        # Resumes the jobs a previous gateway left unfinished, once the router's models are known.
        await batch_jobs.start(app, ready=lambda: bool(registry.models))
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await batch_jobs.close()
            if safety is not None:
                await safety.aclose()

    # FastAPI's own spans are off: RequestContextMiddleware opens the request's root span (gateway.request).
    app = FastAPI(title="Flotilla gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=openapi.OPENAPI_PATH, telemetry={"tracing": False})
    app.state.gateway = context
    app.state.batch_jobs = batch_jobs
    _add_routes(app)
    openapi.install(app)  # generated from the routes (openapi.py)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    return app


def _add_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/messages", anthropic_api.create_message, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", anthropic_api.count_tokens, methods=["POST"])
    app.add_api_route("/v1/chat/completions", openai_api.create_chat_completion, methods=["POST"])
    app.add_api_route("/v1/completions", openai_api.create_completion, methods=["POST"])
    app.add_api_route("/v1/batch-generate", batch_api.batch_generate, methods=["POST"])
    batch_job_routes.add_routes(app)  # /v1/files, /v1/batches, /v1/messages/batches
    app.add_api_route("/v1/moderations", moderations_api.create_moderation, methods=["POST"])
    app.add_api_route("/v1/models", models_api.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", models_api.get_model, methods=["GET"])
    app.add_api_route("/healthz", health.healthz, methods=["GET"])
    app.add_api_route("/readyz", health.readyz, methods=["GET"])


async def _http_exception(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown URLs and wrong methods, in the dialect of the path (OpenAI's unless it is Anthropic's)."""
    err = http_error(exc.status_code, request.method, request.url.path)
    response = error_response(dialect_for_path(request.url.path), err, request.app.state.gateway.settings.retry_after_s)
    if exc.status_code == 405 and exc.headers:
        response.headers.update(exc.headers)  # keeps Allow
    return response
