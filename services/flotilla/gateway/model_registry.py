"""The models the router serves, each with its tokenizer, refreshed from the router.

The gateway has no model files: each model's tokenizer is built from the tokenizer files its workers
published through the router (fetched once per digest and cached), checked against the digest first.

The list is re-read periodically and, throttled, when a request names a model we do not know (a model
that came up since the last refresh should not have to wait a whole period).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.engine.tokenizer_files import check_file_names, files_digest
from flotilla.gateway.errors import ErrorKind, GatewayError
from flotilla.gateway.router_client import RouterBackend

log = logging.getLogger(__name__)


class TokenizerLike(Protocol):
    eos_token_ids: Sequence[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


TokenizerBuilder = Callable[[Mapping[str, bytes]], TokenizerLike]


def build_engine_tokenizer(files: Mapping[str, bytes]) -> TokenizerLike:
    # Imported here so that the gateway starts (and its tests run) without the engine's model stack.
    from flotilla.engine.tokenizer import Tokenizer

    return Tokenizer.from_files(files)


@dataclass(frozen=True)
class ServedModel:
    name: str
    version: str
    max_model_len: int
    assets_digest: str
    aliases: tuple[str, ...]
    tokenizer: TokenizerLike


class ModelRegistry:
    def __init__(self, backend: RouterBackend, tokenizer_builder: TokenizerBuilder = build_engine_tokenizer,
                 min_refresh_gap_s: float = 1.0):
        self._backend = backend
        self._build_tokenizer = tokenizer_builder
        self._min_refresh_gap_s = min_refresh_gap_s
        self._tokenizers: dict[str, TokenizerLike] = {}  # by assets digest: fetched once per model version
        self._by_name: dict[str, ServedModel] = {}  # name, alias and name@version
        self._models: list[ServedModel] = []
        self._lock = asyncio.Lock()
        self._last_attempt = -float("inf")
        self._last_failure: GatewayError | None = None

    @property
    def models(self) -> list[ServedModel]:
        return list(self._models)

    async def refresh(self) -> list[ServedModel]:
        """Re-read the model list; raises GatewayError(UNAVAILABLE) when the router cannot be reached."""
        async with self._lock:
            self._last_attempt = time.monotonic()
            self._last_failure = None
            try:
                infos = await self._list_models()
            except GatewayError as err:
                self._last_failure = err
                raise
            models = [m for m in [await self._served(info) for info in infos] if m is not None]
            self._models = models
            self._by_name = _index(models)
            return list(models)

    async def resolve(self, name: str) -> ServedModel:
        model = self._by_name.get(name)
        if model is None and self._lock.locked():
            # A refresh is under way (the first, right after a start or restart): answer from its list, not
            # with a 404 from the empty one it is about to replace.
            async with self._lock:
                model = self._by_name.get(name)
        if model is None and time.monotonic() - self._last_attempt >= self._min_refresh_gap_s:
            await self.refresh()
            model = self._by_name.get(name)
        if model is None and self._last_failure is not None:
            # A router we cannot reach is a 503 (retry later), not a claim that the model does not exist.
            err = self._last_failure
            raise GatewayError(err.kind, err.message, err.param, err.code)
        if model is None:
            raise GatewayError(ErrorKind.NOT_FOUND, f"model {name!r} not found", param="model",
                               code="model_not_found")
        return model

    async def refresh_forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.refresh()
            except GatewayError as err:
                log.warning("model list refresh failed: %s", err.message)
            await asyncio.sleep(interval_s)

    async def _list_models(self) -> list[common.ModelInfo]:
        try:
            return await self._backend.list_models()
        except Exception as err:  # any transport failure means the same to a caller: not reachable now
            raise GatewayError(ErrorKind.UNAVAILABLE, f"the router is unavailable: {err}",
                               code="unavailable") from err

    async def _served(self, info: common.ModelInfo) -> ServedModel | None:
        tokenizer = await self._tokenizer(info.assets_digest)
        if tokenizer is None:
            return None
        return ServedModel(info.name, info.version, info.max_model_len, info.assets_digest,
                           tuple(info.aliases), tokenizer)

    async def _tokenizer(self, digest: str) -> TokenizerLike | None:
        tokenizer = self._tokenizers.get(digest)
        if tokenizer is None:
            try:
                files = await self._backend.get_model_assets(digest)
                check_file_names(files)
                if files_digest(files) != digest:
                    raise ValueError("the files do not hash to their digest")
                tokenizer = await asyncio.to_thread(self._build_tokenizer, files)
            except Exception as err:
                # The model stays unlisted (and unknown to requests) until its tokenizer can be built here.
                log.warning("cannot build the tokenizer of model assets %r; model skipped: %s", digest, err)
                return None
            self._tokenizers[digest] = tokenizer
        return tokenizer


def _index(models: list[ServedModel]) -> dict[str, ServedModel]:
    """Name and alias lookups take the first model listed; name@version names one version exactly."""
    index: dict[str, ServedModel] = {}
    for model in models:
        index.setdefault(f"{model.name}@{model.version}", model)
    for model in models:
        index.setdefault(model.name, model)
    for model in models:
        for alias in model.aliases:
            index.setdefault(alias, model)
    return index
