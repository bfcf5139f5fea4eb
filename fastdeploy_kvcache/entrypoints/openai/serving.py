"""What the two generation endpoints do: validate, fan out to the engine, stream or collect.

Request bodies arrive already type-checked by pydantic (:mod:`.protocol`).  This module
checks the sampling values and ``max_tokens`` against ``--max-model-len``, turns each request
into one engine request per choice, and shapes the engine's ``RequestOutput`` stream into
OpenAI responses or server-sent events.  The prompts are checked once, by the engine as they
are submitted (``engine/request_checks.py``); its refusals become 400s naming the field.

Every path that leaves before the engine request finishes (client disconnect, error,
cancellation) aborts it, so the engine frees its blocks at its next step.

Work that grows with a request's size stays off the event loop, so one huge prompt cannot
stall every other client: tokenization and chat templating run on a small thread pool
(the tokenizer releases the GIL), and a text prompt that cannot fit the context is refused
before it is tokenized, from its UTF-8 length and the longest token of the vocabulary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Optional, Union

from starlette.requests import Request as HTTPRequest

from fastdeploy_kvcache.entrypoints.auth import check_cache_salt, tenant_cache_salt, tenant_of_scope
from fastdeploy_kvcache.entrypoints.openai.engine_client import (
    AsyncEngineClient,
    EngineDraining,
    RequestGroup,
    SubRequest,
    first_token_latency,
)
from fastdeploy_kvcache.entrypoints.openai.metrics import ServerMetrics
from fastdeploy_kvcache.entrypoints.openai.protocol import (
    CachedTokensByTier,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)

logger = logging.getLogger(__name__)

# The most choices one request may ask for (n, or a list of prompts times n).
MAX_CHOICES = 64
# Threads that tokenize and render chat templates (off the event loop).
TOKENIZER_THREADS = 2


class RequestError(Exception):
    """A bad request: becomes HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 status: int = 400, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type = type_


class ClientDisconnected(Exception):
    """The client closed the connection before its non-streamed response was ready."""


# ---------------------------------------------------------------------- validation
def _reject_unsupported(req: Union[CompletionRequest, ChatCompletionRequest]) -> None:
    """Known OpenAI fields this engine does not implement: only their neutral value passes."""
    checks: list[tuple[str, bool]] = [
        ("presence_penalty", bool(req.presence_penalty)),
        ("frequency_penalty", bool(req.frequency_penalty)),
        ("logit_bias", bool(req.logit_bias)),
    ]
    if isinstance(req, CompletionRequest):
        checks += [
            ("echo", req.echo),
            ("logprobs", req.logprobs is not None),
            ("best_of", req.best_of not in (None, 1)),
            ("suffix", bool(req.suffix)),
        ]
    else:
        fmt = (req.response_format or {}).get("type", "text")
        checks += [
            ("logprobs", bool(req.logprobs)),
            ("top_logprobs", req.top_logprobs is not None and req.top_logprobs != 0),
            ("tools", bool(req.tools)),
            ("tool_choice", req.tool_choice not in (None, "none", "auto")),
            ("response_format", fmt != "text"),
        ]
    for name, bad in checks:
        if bad:
            raise RequestError(f"{name}: not supported by this server", param=name, code="unsupported_parameter")
    extra = sorted((req.model_extra or {}).keys())
    if extra:
        logger.warning("ignoring unknown request fields: %s", ", ".join(extra))


def build_sampling_params(
    req: Union[CompletionRequest, ChatCompletionRequest],
    prompt_len: int,
    max_model_len: int,
    prompt_param: str,
    max_request_tokens: Optional[int] = None,
) -> Any:
    """Check the request's sampling values; return ``SamplingParams``.

    The prompt itself (empty, too long, ids outside the vocabulary, too big for the device
    pool) is the engine's to check, once, when the request is submitted
    (``engine/request_checks.py``).  Here: ``max_tokens`` that would run past
    ``max_model_len`` after a prompt that fits is a 400 (as in vLLM) rather than a silent cut;
    without ``max_tokens`` chat may use the rest of the context (and of the device pool,
    ``max_request_tokens``), and completions default to OpenAI's 16.
    """
    from fastdeploy_kvcache.engine.sampling import SamplingParams  # engine side: lazy

    _reject_unsupported(req)
    prompt_fits = 0 < prompt_len < max_model_len  # else the engine refuses the prompt itself
    room = max_model_len - prompt_len
    max_tokens = req.max_tokens
    param = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is not None:
        if max_tokens <= 0:
            raise RequestError(f"{param}: must be >= 1, got {max_tokens}", param=param)
        if prompt_fits and max_tokens > room:
            raise RequestError(
                f"{param}: {prompt_len} prompt tokens + {max_tokens} = {prompt_len + max_tokens} exceeds this "
                f"model's maximum context length (--max-model-len) of {max_model_len}",
                param=param, code="context_length_exceeded")
    else:
        limit = max_model_len if max_request_tokens is None else min(max_model_len, max_request_tokens)
        # No room left (the prompt fills the context or the pool): 1, which the engine refuses.
        max_tokens = max(1, limit - prompt_len)
    if req.n < 1:
        raise RequestError(f"n: must be >= 1, got {req.n}", param="n")
    if req.temperature is not None and req.temperature < 0:
        raise RequestError(f"temperature: must be >= 0, got {req.temperature}", param="temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise RequestError(f"top_p: must be in (0, 1], got {req.top_p}", param="top_p")
    if req.top_k is not None and (req.top_k == 0 or req.top_k < -1):
        raise RequestError(f"top_k: must be -1 (off) or >= 1, got {req.top_k}", param="top_k")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise RequestError("stop: stop strings must be non-empty", param="stop")
    stop_ids = list(req.stop_token_ids or [])
    if any(t < 0 for t in stop_ids):
        raise RequestError("stop_token_ids: token ids must be >= 0", param="stop_token_ids")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=-1 if req.top_k is None else int(req.top_k),
        seed=req.seed,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=bool(req.ignore_eos),
    )
    try:
        params.validate()
    except ValueError as exc:
        raise _request_error(exc, prompt_param, param) from exc
    return params


def check_text_fits(min_tokens: int, max_model_len: int, prompt_param: str, what: str) -> None:
    """400 when a text prompt has at least ``min_tokens`` tokens (a bound from its bytes, found
    before tokenizing it) and so cannot leave room to generate; worded as the engine's check."""
    from fastdeploy_kvcache.engine.request_checks import prompt_too_long  # engine side: lazy

    if min_tokens >= max_model_len:
        raise _request_error(prompt_too_long(min_tokens, max_model_len, what), prompt_param)


def _request_error(exc: Exception, prompt_param: str, max_tokens_param: str = "max_tokens") -> RequestError:
    """The engine's ValueError as a 400: ``RequestRejected`` keeps its field (named as this
    request names it) and code; any other names its field in the message's first word."""
    param = getattr(exc, "param", None)
    if param is not None:
        param = {"prompt": prompt_param, "max_tokens": max_tokens_param}.get(param, param)
        return RequestError(f"{param}: {exc.detail}", param=param, code=exc.code)  # type: ignore[attr-defined]
    field = str(exc).split(":", 1)[0].strip()
    return RequestError(str(exc), param=field if field.isidentifier() else None)


def utf8_size(text: str, param: str) -> int:
    """Bytes of ``text`` in UTF-8; 400 for a lone UTF-16 surrogate (JSON allows ``"\\ud800"``)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"{param}: not valid Unicode text: a lone UTF-16 surrogate U+{ord(text[exc.start]):04X} at "
            f"character {exc.start} (a \\uD800-\\uDFFF escape must be half of a pair)", param=param) from None


def max_token_bytes(tokenizer: Any) -> Optional[int]:
    """The most UTF-8 bytes one token's text spans (an upper bound), or None if unknown.

    For the byte-level BPE tokenizers the engine builds, a token's string has one
    character per input byte, so its UTF-8 length bounds the bytes it covers; hence a text
    of B bytes has at least B / max_token_bytes tokens.
    """
    vocab = getattr(tokenizer, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0 or not hasattr(tokenizer, "convert_ids_to_tokens"):
        return None
    tokens = tokenizer.convert_ids_to_tokens(range(vocab))
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tokens if t), default=0)
    return longest or None


def _with_seed(params: Any, seed: Optional[int]) -> Any:
    import dataclasses

    return dataclasses.replace(params, seed=seed)


def _fan_out(prompts: list[tuple[list[int], Any]], n: int) -> list[SubRequest]:
    """One engine request per (prompt, choice); choice j of a seeded request gets seed + j."""
    subs: list[SubRequest] = []
    base = uuid.uuid4().hex
    for p_idx, (ids, params) in enumerate(prompts):
        for j in range(n):
            index = p_idx * n + j
            if n > 1 and params.seed is not None:
                params_j = dataclasses.replace(params, seed=params.seed + j)
            else:
                params_j = params
            subs.append(SubRequest(index, f"{base}-{index}", ids, params_j))
    return subs


# ---------------------------------------------------------------------- usage
def usage_of(output: Any) -> UsageInfo:
    """Usage of one finished engine request; cached tokens are split by tier (extension)."""
    by_tier = getattr(output, "cached_tokens_by_tier", None) or {}
    prompt = int(output.num_prompt_tokens)
    completion = int(output.num_output_tokens)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=int(output.num_cached_tokens),
            cached_tokens_by_tier=CachedTokensByTier(**{t: int(by_tier.get(t, 0)) for t in ("device", "host", "storage")}),
        ),
    )


def _choices_and_usage(results: dict[int, dict[str, Any]], n: int,
                       make_choice: Callable[[int, str, Optional[str]], Any]) -> tuple[list[Any], UsageInfo]:
    """A non-streamed response's choices (by index) and usage, for completions and chat alike.

    A prompt's tokens count once however many of its ``n`` choices there are (the first).
    """
    choices, usage = [], UsageInfo()
    for index in sorted(results):
        out = results[index]["out"]
        choices.append(make_choice(index, "".join(results[index]["text"]), out.finish_reason))
        usage.add(usage_of(out), include_prompt=index % n == 0)
    return choices, usage


class OpenAIServing:
    """The handlers of ``/v1/completions`` and ``/v1/chat/completions``."""

    def __init__(self, client: AsyncEngineClient, metrics: ServerMetrics, served_model_names: list[str],
                 tenant_isolation: str = "none") -> None:
        self.client = client
        # "salt": every request is salted by its API key's tenant (entrypoints/auth.py).
        self.salt_by_tenant = tenant_isolation == "salt"
        self.metrics = metrics
        self.served_model_names = served_model_names
        self.max_token_bytes = max_token_bytes(client.tokenizer)
        # Its own pool: the default executor serves /metrics and /health?verbose=1, which
        # must not queue behind a long tokenization.
        self._tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="fdkv-tokenize")

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    # ------------------------------------------------------------------ helpers
    def check_model(self, model: str) -> None:
        if model not in self.served_model_names:
            raise RequestError(
                f"model: {model!r} is not served here; available: {', '.join(self.served_model_names)}",
                param="model", code="model_not_found")

    def _encode(self, text: str, param: str) -> list[int]:
        """Token ids of a text prompt; refused first if its size alone shows it cannot fit."""
        size = utf8_size(text, param)
        if self.max_token_bytes:
            check_text_fits(-(-size // self.max_token_bytes), self.client.max_model_len, param,
                            what=f"{size} bytes of text, so at least ")
        return self.client.tokenizer.encode(text)

    def _completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """The prompts as token ids (runs off the loop); the engine checks them when they are submitted."""
        p = req.prompt
        if isinstance(p, str):
            prompts = [self._encode(p, "prompt")]
        elif not p:
            raise RequestError("prompt: must not be an empty list", param="prompt")
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        elif all(isinstance(x, str) for x in p):
            prompts = [self._encode(x, "prompt") for x in p]  # type: ignore[arg-type]
        else:
            prompts = [list(x) for x in p]  # type: ignore[union-attr]
        return prompts

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The messages rendered by the chat template, as token ids (runs off the loop)."""
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        # Every template renders each message's content, so their bytes bound the prompt's.
        size = sum(utf8_size(m["content"], f"messages[{i}].content") for i, m in enumerate(messages))
        if self.max_token_bytes:
            check_text_fits(-(-size // self.max_token_bytes), self.client.max_model_len, "messages",
                            what=f"{size} bytes of message text, so at least ")
        try:
            return list(self.client.tokenizer.apply_chat_template(messages))
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise RequestError(f"messages: the chat template failed: {exc}", param="messages") from exc

    def _check_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > MAX_CHOICES:
            raise RequestError(f"n: at most {MAX_CHOICES} choices per request (prompts x n), got "
                               f"{num_prompts * n}", param="n")

    def _cache_keys(self, req: Union[CompletionRequest, ChatCompletionRequest],
                    raw: HTTPRequest) -> tuple[Optional[str], Optional[str]]:
        """``(cache_salt, tenant)`` the request's blocks are hashed with and it is counted under.

        Without a salt (the common case) nothing is added to the hashing (core/hashing.py).
        """
        try:
            salt = check_cache_salt(req.cache_salt)
        except ValueError as exc:
            raise RequestError(str(exc), param="cache_salt") from exc
        tenant = tenant_of_scope(raw.scope)
        if self.salt_by_tenant:
            salt = tenant_cache_salt(tenant, salt)
        return salt, tenant

    def _submit(self, prompts: list[list[int]], req: Union[CompletionRequest, ChatCompletionRequest],
                prompt_param: str, raw: HTTPRequest) -> RequestGroup:
        self._check_choices(len(prompts), req.n)
        salt, tenant = self._cache_keys(req, raw)
        params_per_prompt = [build_sampling_params(req, len(ids), self.client.max_model_len, prompt_param,
                                                   self.client.max_request_tokens)
                             for ids in prompts]
        subs = _fan_out(list(zip(prompts, params_per_prompt)), req.n)
        if salt is not None or tenant is not None:
            for sub in subs:
                sub.cache_salt, sub.tenant = salt, tenant
        _attach_kv_transfer(req, subs)  # PD decode (engine/pd.py)
        try:
            return self.client.submit(subs, on_abandoned_finish=lambda out: self.metrics.observe_finished(out, None))
        except ValueError as exc:  # the engine's checks of the prompt and the parameters
            max_tokens_param = ("max_completion_tokens" if isinstance(req, ChatCompletionRequest)
                                and req.max_completion_tokens is not None else "max_tokens")
            raise _request_error(exc, prompt_param, max_tokens_param) from exc
        except EngineDraining as exc:
            raise RequestError(str(exc), status=503, type_="server_error", code="shutting_down") from exc

    async def _outputs(self, group: RequestGroup, arrival: float) -> AsyncIterator[tuple[int, Any]]:
        """The group's outputs, with metrics recorded; aborts the group if left early."""
        seen_first: set[int] = set()
        try:
            async for index, out in group:
                if out.new_token_ids and index not in seen_first:
                    seen_first.add(index)
                    ttft = first_token_latency(out)
                    self.metrics.observe_first_token(ttft if ttft is not None else time.monotonic() - arrival)
                if out.finished:
                    self.metrics.observe_finished(out, time.monotonic() - arrival)
                yield index, out
        finally:
            if not group.finished:
                group.abort()

    async def _collect(self, group: RequestGroup, raw: HTTPRequest, arrival: float) -> dict[int, dict[str, Any]]:
        """All outputs of a non-streamed request, aborting it if the client disconnects."""
        results: dict[int, dict[str, Any]] = {}

        async def consume() -> None:
            async for index, out in self._outputs(group, arrival):
                slot = results.setdefault(index, {"text": [], "out": None, "ids": []})
                slot["text"].append(out.text)
                slot["ids"].extend(out.new_token_ids)
                if out.finished:
                    slot["out"] = out

        consumer = asyncio.ensure_future(consume())
        # After the body is read, receive() returns only when the client disconnects (or
        # the response completes): no polling.
        watcher = asyncio.ensure_future(raw.receive())
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if consumer not in done:
                message = watcher.result()
                if message.get("type") == "http.disconnect":
                    logger.info("client disconnected; aborting its %d engine request(s)", len(results) or 1)
                    consumer.cancel()
                    group.abort()
                    raise ClientDisconnected()
                await consumer
            consumer.result()
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
            if not group.finished:
                group.abort()
        for slot in results.values():
            out = slot["out"]
            if out is not None and out.finish_reason == "error":
                raise RequestError(f"engine error: {out.error}", status=500, type_="server_error")
        return results

    def _prefill_handoff(self, results: dict[int, dict[str, Any]]) -> Optional[dict[str, Any]]:
        return _prefill_handoff_of(getattr(self.client, "engine", None), results)

    # ------------------------------------------------------------------ completions
    async def create_completion(self, req: CompletionRequest, raw: HTTPRequest) -> Any:
        arrival = time.monotonic()
        self.check_model(req.model)
        p = req.prompt
        single = isinstance(p, str) or bool(p) and all(isinstance(x, int) for x in p)  # type: ignore[union-attr]
        self._check_choices(1 if single else len(p), req.n)  # before tokenizing every prompt
        prompts = await self._off_loop(self._completion_prompts, req)
        group = self._submit(prompts, req, "prompt", raw)
        if req.stream:
            return self._completion_stream(req, group, arrival)
        results = await self._collect(group, raw, arrival)
        choices, usage = _choices_and_usage(results, req.n, lambda index, text, finish: CompletionChoice(
            index=index, text=text, finish_reason=finish))
        return CompletionResponse(model=req.model, choices=choices, usage=usage,
                                  kv_transfer_params=self._prefill_handoff(results))

    async def _completion_stream(self, req: CompletionRequest, group: RequestGroup,
                                 arrival: float) -> AsyncIterator[str]:
        rid, created = random_id("cmpl"), int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        usage = UsageInfo()
        try:
            async for index, out in self._outputs(group, arrival):
                if out.text or out.finished:
                    chunk = CompletionResponse(
                        id=rid, created=created, model=req.model,
                        choices=[CompletionChoice(index=index, text=out.text,
                                                  finish_reason=out.finish_reason if out.finished else None)])
                    yield _sse(chunk.model_dump(exclude_none=False))
                if out.finished:
                    usage.add(usage_of(out), include_prompt=index % req.n == 0)
                    if out.finish_reason == "error":
                        yield _sse_error(f"engine error: {out.error}")
            if include_usage:
                yield _sse(CompletionResponse(id=rid, created=created, model=req.model, choices=[],
                                              usage=usage).model_dump())
            yield "data: [DONE]\n\n"
        finally:
            if not group.finished:
                group.abort()

    # ------------------------------------------------------------------ chat
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: HTTPRequest) -> Any:
        arrival = time.monotonic()
        self.check_model(req.model)
        ids = await self._off_loop(self._chat_prompt, req)
        group = self._submit([ids], req, "messages", raw)
        if req.stream:
            return self._chat_stream(req, group, arrival)
        results = await self._collect(group, raw, arrival)
        choices, usage = _choices_and_usage(results, req.n, lambda index, text, finish: ChatCompletionChoice(
            index=index, message=ChatResponseMessage(content=text), finish_reason=finish))
        return ChatCompletionResponse(model=req.model, choices=choices, usage=usage,
                                      kv_transfer_params=self._prefill_handoff(results))

    async def _chat_stream(self, req: ChatCompletionRequest, group: RequestGroup,
                           arrival: float) -> AsyncIterator[str]:
        rid, created = random_id("chatcmpl"), int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        usage = UsageInfo()

        def chunk(choices: list[ChatCompletionStreamChoice], usage_: Optional[UsageInfo] = None) -> str:
            return _sse(ChatCompletionChunk(id=rid, created=created, model=req.model, choices=choices,
                                            usage=usage_).model_dump())

        try:
            # OpenAI sends the role first, in a chunk of its own, for every choice.
            for index in range(group.num_choices):
                yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            async for index, out in self._outputs(group, arrival):
                if out.text:
                    yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=out.text))])
                if out.finished:
                    usage.add(usage_of(out), include_prompt=index % req.n == 0)
                    yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(),
                                                            finish_reason=out.finish_reason)])
                    if out.finish_reason == "error":
                        yield _sse_error(f"engine error: {out.error}")
            if include_usage:
                yield chunk([], usage)
            yield "data: [DONE]\n\n"
        finally:
            if not group.finished:
                group.abort()


# ---------------------------------------------------------------------- PD hand-off (engine/pd.py)
def _attach_kv_transfer(req: Union[CompletionRequest, ChatCompletionRequest], subs: list[SubRequest]) -> None:
    """A decode server's ``kv_transfer_params``: checked here (400 naming the field), then
    carried by the (single) engine request."""
    if req.kv_transfer_params is None:
        return
    from fastdeploy_kvcache.engine.pd import parse_kv_transfer_params

    if len(subs) != 1:
        raise RequestError("kv_transfer_params: a hand-off carries one prompt and n=1", param="kv_transfer_params")
    try:
        subs[0].kv_transfer = parse_kv_transfer_params(req.kv_transfer_params)
    except ValueError as exc:
        raise RequestError(str(exc), param="kv_transfer_params") from exc


def _prefill_handoff_of(engine: Any, results: dict[int, dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A prefill server's answer carries its token ids for the decode server; others: None."""
    pd = getattr(engine, "pd", None)
    if pd is None or pd.role != "prefill" or len(results) != 1:
        return None
    slot = next(iter(results.values()))
    out = slot["out"]
    return {"prefill_token_ids": list(slot.get("ids", [])), "request_key": out.request_id,
            "num_prompt_tokens": int(out.num_prompt_tokens)}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _sse_error(message: str) -> str:
    return _sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
