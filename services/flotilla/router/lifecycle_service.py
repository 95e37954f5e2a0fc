"""RouterService's model lifecycle RPCs (`flotilla models ...`): list routes, set aliases, roll out, promote,
roll back, compare versions. One handler per RPC, each a thin translation onto ModelRoutes (model_routes.py);
a refused change is a gRPC status (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION) with the reason."""

from __future__ import annotations

import asyncio
import time

import grpc

from flotilla.api.router.v1 import router_pb2 as rpb
from flotilla.router.admission import Admission
from flotilla.router.golden_check import NUM_TOKENS, GoldenResult, compare
from flotilla.router.metrics import RouterMetrics
from flotilla.router.model_routes import Change, ModelRoutes, RouteChangeError
from flotilla.router.models import ModelVersionRef
from flotilla.router.registry import WorkerRegistry

DEFAULT_STATUS_WINDOW_S = 600.0

_STATUS_OF_KIND = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "not_found": grpc.StatusCode.NOT_FOUND,
                   "precondition": grpc.StatusCode.FAILED_PRECONDITION}


class ModelLifecycleRpcs:
    """Mixed into RouterService, which provides the registry, admission (its routes) and metrics."""

    _registry: WorkerRegistry
    _admission: Admission
    metrics: RouterMetrics
    _golden: dict[str, GoldenResult]  # model name -> its last rollout's golden check
    _golden_tasks: set[asyncio.Task]

    def _init_lifecycle(self) -> None:
        self._golden = {}
        self._golden_tasks = set()  # running checks (a reference, so they are not collected mid-way)

    @property
    def _routes(self) -> ModelRoutes:
        return self._admission.routes

    def _versions(self) -> list[ModelVersionRef]:
        versions = self._registry.model_versions()
        self._routes.observe(versions)  # a first version is adopted before anyone asks for it
        return versions

    async def ListModelRoutes(self, request: rpb.ListModelRoutesRequest, context: grpc.aio.ServicerContext
                              ) -> rpb.ListModelRoutesResponse:
        self._versions()
        routes = self._routes
        return rpb.ListModelRoutesResponse(
            routes=[self._route_proto(name) for name in sorted(routes.routes)],
            aliases=[rpb.ModelAlias(alias=a, target=t) for a, t in sorted(routes.aliases.items())],
            recent_changes=[_change_proto(c) for c in routes.history()])

    async def SetModelAlias(self, request: rpb.SetModelAliasRequest, context: grpc.aio.ServicerContext
                            ) -> rpb.ModelRouteResponse:
        change = await self._change(context, lambda: self._routes.set_alias(request.alias, request.target))
        name = request.target.partition("@")[0]
        response = rpb.ModelRouteResponse(change=_change_proto(change))
        if name in self._routes.routes:
            response.route.CopyFrom(self._route_proto(name))
        return response

    async def SetModelRollout(self, request: rpb.SetModelRolloutRequest, context: grpc.aio.ServicerContext
                              ) -> rpb.ModelRouteResponse:
        def start() -> tuple[str, Change]:
            versions = self._versions()
            name = self._routes.model_name(request.model)
            self._check_same_tokenizer(name, request.version, versions)
            return self._routes.set_rollout(request.model, request.version, request.weight_percent, versions)

        answer = await self._route_change(context, start)
        route = answer.route
        golden = self._golden.get(route.name)
        if golden is None or golden.candidate != route.candidate_version:  # a new rollout, not a weight change
            self._start_golden_check(route.name, route.current_version, route.candidate_version)
        return answer

    async def PromoteModel(self, request: rpb.PromoteModelRequest, context: grpc.aio.ServicerContext
                           ) -> rpb.ModelRouteResponse:
        return await self._route_change(context, lambda: self._routes.promote(request.model))

    async def RollbackModel(self, request: rpb.RollbackModelRequest, context: grpc.aio.ServicerContext
                            ) -> rpb.ModelRouteResponse:
        return await self._route_change(context, lambda: self._routes.rollback(request.model, self._versions()))

    async def GetModelStatus(self, request: rpb.GetModelStatusRequest, context: grpc.aio.ServicerContext
                             ) -> rpb.GetModelStatusResponse:
        self._versions()
        name = await self._change(context, lambda: self._routes.model_name(request.model))
        if name not in self._routes.routes:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} has no registered version")
        window_s = request.window_s if request.window_s > 0 else DEFAULT_STATUS_WINDOW_S
        route = self._routes.routes[name]
        stats = self.metrics.versions
        known = sorted({ref.version for ref in self._registry.model_versions() if ref.name == name})
        ordered = [v for v in (route.current, route.candidate, route.previous) if v]
        ordered += [v for v in known if v not in ordered]
        versions = []
        for version in ordered:
            summary = stats.summary(name, version, window_s)
            versions.append(rpb.VersionStats(
                version=version, role=_role(route, version), weight_percent=_weight(route, version),
                num_requests=summary.num_requests, error_rate=summary.error_rate, cancel_rate=summary.cancel_rate,
                ttft_p50_s=summary.ttft_s[0], ttft_p95_s=summary.ttft_s[1], ttft_p99_s=summary.ttft_s[2],
                tpot_p50_s=summary.tpot_s[0], tpot_p95_s=summary.tpot_s[1], tpot_p99_s=summary.tpot_s[2],
                mean_output_tokens=summary.mean_output_tokens, num_inflight=stats.num_inflight(name, version)))
        return rpb.GetModelStatusResponse(route=self._route_proto(name), versions=versions, window_s=window_s,
                                          recent_changes=[_change_proto(c) for c in self._routes.history(name)],
                                          golden=_golden_proto(self._golden.get(name)))

    # ---- golden check --------------------------------------------------------------------------------
    def _start_golden_check(self, name: str, baseline: str, candidate: str) -> None:
        results = self._golden
        results[name] = GoldenResult(baseline, candidate)  # running

        async def run() -> None:
            result = await compare(self._registry, name, baseline, candidate)
            if results.get(name, result).candidate == candidate:
                results[name] = result

        task = asyncio.create_task(run())
        self._golden_tasks.add(task)
        task.add_done_callback(self._golden_tasks.discard)

    # ---- helpers -------------------------------------------------------------------------------------
    async def _route_change(self, context: grpc.aio.ServicerContext, apply) -> rpb.ModelRouteResponse:
        name, change = await self._change(context, apply)
        self._admission.dispatch()  # queued requests are placed under the new route at once
        return rpb.ModelRouteResponse(route=self._route_proto(name), change=_change_proto(change))

    @staticmethod
    async def _change(context: grpc.aio.ServicerContext, apply):
        try:
            return apply()
        except RouteChangeError as err:
            await context.abort(_STATUS_OF_KIND[err.kind], err.message)

    def _check_same_tokenizer(self, name: str, version: str, versions: list[ModelVersionRef]) -> None:
        """The gateway tokenizes a name's requests with its current version's tokenizer: a candidate must
        share it (and its context window), or its conversations would get token ids it does not read."""
        route = self._routes.routes.get(name)
        matches = [ref.version for ref in versions if ref.name == name and ref.version.startswith(version)]
        if route is None or not route.current or len(matches) != 1:
            return  # ModelRoutes says what is wrong
        current = self._registry.model_info(name, route.current)
        candidate = self._registry.model_info(name, matches[0])
        if current is None or candidate is None:
            return
        if current.assets_digest != candidate.assets_digest or current.max_model_len != candidate.max_model_len:
            raise RouteChangeError("precondition", f"{name}@{matches[0]} has another tokenizer or context window "
                                                   f"than {name}@{route.current}: serve it under its own name")

    def _route_proto(self, name: str) -> rpb.ModelRoute:
        route = self._routes.routes[name]
        now = time.monotonic()
        summaries: dict[str, rpb.ModelVersionSummary] = {}
        for entry in self._registry.workers():
            if entry.model_name != name or entry.is_fixed_batch:
                continue
            summary = summaries.setdefault(entry.version, rpb.ModelVersionSummary(version=entry.version))
            summary.num_workers += 1
            summary.num_healthy_active += self._registry.is_healthy(entry) and entry.state == rpb.WORKER_STATE_ACTIVE
            summary.first_registered_s_ago = max(summary.first_registered_s_ago, now - entry.registered_at)
        for entry in self._registry.shared_workers():  # a shared-pool worker can serve it; placeable while loaded
            for model in (m for m in entry.info.shared.models if m.name == name):
                summary = summaries.setdefault(model.version, rpb.ModelVersionSummary(version=model.version))
                summary.num_workers += 1
                summary.num_healthy_active += (self._registry.is_healthy(entry) and entry.has_loaded(
                    f"{name}@{model.version}") and entry.state == rpb.WORKER_STATE_ACTIVE)
                summary.first_registered_s_ago = max(summary.first_registered_s_ago, now - entry.registered_at)
        return rpb.ModelRoute(name=name, current_version=route.current, candidate_version=route.candidate,
                              candidate_weight_percent=route.candidate_percent if route.candidate else 0.0,
                              previous_version=route.previous, managed=route.managed,
                              versions=sorted(summaries.values(), key=lambda s: s.first_registered_s_ago),
                              aliases=self._routes.aliases_of_name(name))


def _role(route, version: str) -> str:
    return {route.current: "current", route.candidate: "candidate", route.previous: "previous"}.get(version, "other")


def _weight(route, version: str) -> float:
    if version == route.candidate:
        return route.candidate_percent
    if version == route.current:
        return 100.0 - (route.candidate_percent if route.candidate else 0.0)
    return 0.0


def _golden_proto(result: GoldenResult | None) -> rpb.GoldenCheck | None:
    if result is None:
        return None
    return rpb.GoldenCheck(baseline_version=result.baseline, candidate_version=result.candidate,
                           num_prompts=result.num_prompts, num_identical=result.num_identical,
                           mean_common_prefix_tokens=result.mean_common_prefix, num_tokens=NUM_TOKENS,
                           error=result.error, done=result.done)


def _change_proto(change: Change) -> rpb.RouteChange:
    return rpb.RouteChange(at_unix_s=change.at_unix_s, action=change.action, model=change.model,
                           detail=change.detail)
