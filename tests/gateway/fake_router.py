"""An in-process RouterService over real grpc.aio that streams canned tokens, chosen by model name:

- "tiny" (alias "tiny-latest"): tokens 100, 101, ... with text "w0 ", "w1 ", ... two per chunk; ends with
  LENGTH at max_tokens, STOP with the first stop string after 2 tokens when stop strings are given, else
  STOP (eos) after NUM_NATURAL_TOKENS tokens. Usage reports CACHED_TOKENS cached prompt tokens.
- "busy" / "gone": an OVERLOADED / UNAVAILABLE error before any token.
- "midfail": one chunk, then an INTERNAL error.
- "hang": one chunk, then waits until cancelled (the cancellation is recorded).
- "script": the texts in `FakeRouter.script`, one token per text, then STOP (eos): a model output chosen by the
  test (tool calls, say), token ids FIRST_TOKEN_ID, FIRST_TOKEN_ID + 1, ...
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import grpc

from flotilla.api.common.v1 import common_pb2 as common
from flotilla.api.router.v1 import router_pb2, router_pb2_grpc
from flotilla.engine.tokenizer_files import files_digest, read_tokenizer_files
from flotilla.rpc.model_assets import asset_chunks
from flotilla.rpc.session_server import serve_session

NUM_NATURAL_TOKENS = 6
CACHED_TOKENS = 3
FIRST_TOKEN_ID = 100
EOS_TOKEN_ID = 2
MAX_MODEL_LEN = 128
SCRIPT_MAX_MODEL_LEN = 4096  # room for tool definitions in the prompt
MODEL_NAMES = ("tiny", "busy", "gone", "midfail", "hang", "script")


def token_text(i: int) -> str:
    return f"w{i} "


def canned_text(num_tokens: int) -> str:
    return "".join(token_text(i) for i in range(num_tokens))


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, checkpoint_path: str):
        # The tokenizer files a worker of this checkpoint would publish: what the gateway tokenizes with.
        self.tokenizer_files = read_tokenizer_files(checkpoint_path)
        self.assets_digest = files_digest(self.tokenizer_files)
        self.num_asset_fetches = 0
        self.models = [common.ModelInfo(name=name, version="v1",
                                        max_model_len=SCRIPT_MAX_MODEL_LEN if name == "script" else MAX_MODEL_LEN,
                                        assets_digest=self.assets_digest,
                                        aliases=["tiny-latest"] if name == "tiny" else [])
                       for name in MODEL_NAMES]
        self.requests: list[common.GenerateRequest] = []
        self.script: list[str] = []  # what model "script" answers
        self.script_delay_s = 0.0  # between its chunks (else the gateway may read several as one)
        self.cancelled: list[common.GenerateRequest] = []
        self.queue_wait_s: float | None = None  # what GetQueueLoad answers for every model
        self._changed = threading.Condition()

    def add_model(self, info: common.ModelInfo) -> None:
        self.models = [*self.models, info]

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        """Blocks the calling (test) thread until predicate() holds or the deadline passes."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout=timeout_s)

    def request_by_id(self, request_id: str) -> common.GenerateRequest:
        return next(r for r in self.requests if r.request_id == request_id)

    async def ListModels(self, request, context):
        return router_pb2.ListModelsResponse(models=self.models)

    async def GetQueueLoad(self, request, context):
        """Every asked model's backlog wait is `queue_wait_s` (None: unmeasured)."""
        response = router_pb2.GetQueueLoadResponse()
        for name in request.models:
            load = response.models.add(model=name)
            if self.queue_wait_s is not None:
                load.interactive_wait_s = self.queue_wait_s
        return response

    async def GetModelAssets(self, request, context):
        if request.digest != self.assets_digest:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown digest")
        self.num_asset_fetches += 1
        for chunk in asset_chunks(request.digest, self.tokenizer_files, chunk_bytes=64 * 1024):
            yield chunk

    async def GenerateSession(self, actions, context):
        """What the gateway calls: the canned Generate streams, multiplexed like the real router's."""
        async def handler(request: common.GenerateRequest, sink) -> None:
            async for response in self.Generate(request, sink):
                await sink.write(response)

        await serve_session(actions, context, handler)

    async def Generate(self, request: common.GenerateRequest, context):
        self._record(self.requests, request)
        behaviour = {"busy": self._error(common.ERROR_CODE_OVERLOADED, "queue full"),
                     "gone": self._error(common.ERROR_CODE_UNAVAILABLE, "no worker serves the model"),
                     "midfail": self._midfail(), "hang": self._hang(request),
                     "script": self._script(request)}.get(request.model)
        async for response in behaviour or self._tokens(request):
            yield response

    async def _tokens(self, request: common.GenerateRequest):
        num_tokens, finished = _plan(request)
        for start in range(0, num_tokens, 2):
            ids = list(range(start, min(start + 2, num_tokens)))
            yield common.GenerateResponse(chunk=_chunk(ids, request.sampling))
        yield common.GenerateResponse(finished=finished)

    async def _script(self, request: common.GenerateRequest):
        for i, text in enumerate(self.script):
            if i and self.script_delay_s:
                await asyncio.sleep(self.script_delay_s)
            yield common.GenerateResponse(chunk=common.TokenChunk(token_ids=[FIRST_TOKEN_ID + i], text=text))
        usage = common.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(self.script))
        yield common.GenerateResponse(finished=common.Finished(reason=common.FINISH_REASON_STOP,
                                                               stop_token_id=EOS_TOKEN_ID, usage=usage))

    async def _error(self, code: int, message: str):
        yield common.GenerateResponse(error=common.Error(code=code, message=message))

    async def _midfail(self):
        yield common.GenerateResponse(chunk=_chunk([0], common.SamplingParams()))
        yield common.GenerateResponse(error=common.Error(code=common.ERROR_CODE_INTERNAL, message="worker died"))

    async def _hang(self, request: common.GenerateRequest):
        yield common.GenerateResponse(chunk=_chunk([0], common.SamplingParams()))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self._record(self.cancelled, request)
            raise

    def _record(self, records: list, request: common.GenerateRequest) -> None:
        with self._changed:
            records.append(request)
            self._changed.notify_all()


def _chunk(indices: list[int], sampling: common.SamplingParams) -> common.TokenChunk:
    logprobs = []
    if sampling.HasField("logprobs"):
        num_top = sampling.logprobs
        logprobs = [common.TokenLogprob(token_id=FIRST_TOKEN_ID + i, logprob=-0.5 - i,
                                        top_token_ids=[FIRST_TOKEN_ID + i + k for k in range(num_top)],
                                        top_logprobs=[-0.5 - i - k for k in range(num_top)]) for i in indices]
    return common.TokenChunk(token_ids=[FIRST_TOKEN_ID + i for i in indices],
                             text="".join(token_text(i) for i in indices), logprobs=logprobs)


def _plan(request: common.GenerateRequest) -> tuple[int, common.Finished]:
    sampling = request.sampling
    natural = 2 if sampling.stop else NUM_NATURAL_TOKENS
    num_tokens = min(sampling.max_tokens, natural)
    usage = common.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=num_tokens,
                         cached_prompt_tokens=CACHED_TOKENS)
    if sampling.max_tokens < natural:
        return num_tokens, common.Finished(reason=common.FINISH_REASON_LENGTH, usage=usage)
    if sampling.stop:
        return num_tokens, common.Finished(reason=common.FINISH_REASON_STOP, stop_sequence=sampling.stop[0],
                                           usage=usage)
    return num_tokens, common.Finished(reason=common.FINISH_REASON_STOP, stop_token_id=EOS_TOKEN_ID, usage=usage)
