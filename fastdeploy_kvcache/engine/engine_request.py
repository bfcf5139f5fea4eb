"""``EngineRequest``: a request as the engine tracks it, the cache's ``Request`` plus its generation state.

The engine (``engine/llm_engine.py``) creates one per queued request and emits its outputs;
the scheduler (``engine/scheduler.py``) moves it between the waiting and running queues and
records what its admission found cached.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.engine.outputs import RequestOutput
from fastdeploy_kvcache.engine.sampling import RequestSampler, SamplingParams
from fastdeploy_kvcache.engine.tokenizer import IncrementalDetokenizer

__all__ = ["EngineRequest", "OutputCallback"]

OutputCallback = Callable[[RequestOutput], None]


class EngineRequest:
    """A request as the engine tracks it: the cache fields (``req``) plus generation state."""

    def __init__(
        self, req: Request, params: SamplingParams, on_output: OutputCallback, sampler: RequestSampler,
        detok: IncrementalDetokenizer, arrival_time: float,
    ) -> None:
        self.req = req
        self.params = params
        self.on_output = on_output
        self.sampler = sampler
        self.detok = detok
        self.arrival_time = arrival_time
        self.first_token_time: Optional[float] = None
        self.cached_device = 0
        self.cached_host = 0
        self.cached_storage = 0  # host hits that this request's storage prefetch brought in
        self.admitted = False  # got its first blocks at least once
        self.admitted_time: Optional[float] = None  # time.monotonic() of that first admission
        self.fetch: Optional[dict[str, Any]] = None  # the storage fetch it waited for (StorageTier.fetch_timing)
        self.first_step: Optional[dict[str, Any]] = None  # the admitting step's phases (request_timing.py)
        self.text_sent = 0  # chars of detok.text already emitted
        self.stop_at: Optional[int] = None  # where a stop string starts in detok.text
        self.finished = False
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.kv_transfer: Optional[Any] = None  # PD decode: engine/pd.py KVTransferParams

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def num_cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage
