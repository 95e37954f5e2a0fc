"""What a caller asks the engine for: one typed value from the gateway to the engine, instead of a parameter list
repeated at every layer. rpc/convert.py turns it into a GenerateRequest and back; the engine turns it into its
own Request state (request.py) when it queues it.

A resumed stream (failover: its worker was lost after it had sent tokens) carries the tokens already delivered
to the caller apart from the prompt: the engine prefills prompt + delivered, continues the sampler's seeds at
output index len(delivered) and holds back the same text as the first attempt, so nothing is sent twice or lost
(LLMEngine.add_request). `sampling_params.max_tokens` then counts only the tokens still to come.
"""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.engine.request import Priority
from flotilla.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    cache_salt: str = ""  # the tenant's: prefix-cache hits never cross salts
    tenant_id: str = ""
    deadline_unix_s: float = 0.0  # 0 = none; the router sheds and times out by it
    delivered_token_ids: tuple[int, ...] = ()  # a resumed stream: output an earlier attempt already delivered

    @property
    def num_prompt_tokens(self) -> int:
        """The caller's prompt, without the delivered tokens a resumed stream prefills as well."""
        return len(self.prompt_token_ids)
