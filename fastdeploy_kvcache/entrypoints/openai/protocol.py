"""Request and response bodies of the OpenAI-compatible API (pydantic v2 models).

The request models accept what the official ``openai`` client sends, with strict types
(``"stream": "yes"`` and ``"max_tokens": true`` are errors, not ``true`` and 1).  Type errors
are pydantic's job (the server maps its 422 to an OpenAI-style 400); text that is not valid
Unicode is refused as the body is parsed (:mod:`.json_body`); value checks that need the
engine's limits live in :mod:`.serving` and the engine.  Fields that OpenAI defines but this engine
does not implement are accepted only at their neutral value, so that nothing a client
asks for is silently ignored.

Extensions beyond OpenAI (vLLM spells them the same way): ``top_k``, ``stop_token_ids``,
``ignore_eos``, ``cache_salt``, and in the response ``usage.prompt_tokens_details.cached_tokens_by_tier``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


def random_id(prefix: str) -> str:
    """OpenAI-style object id (``cmpl-...``, ``chatcmpl-...``); uuid4, not seeded on purpose."""
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # NOTE: unknown request fields are kept (extra="allow") and logged by the server
    # rather than rejected: newer clients add fields, and a 400 for each would break
    # them.  Known-but-unsupported fields are rejected unless neutral (see serving.py).
    # strict: a boolean is true or false and an integer is a JSON integer; pydantic's lax
    # mode would take "yes" as true and true as 1.  (A float field still takes an integer.)
    model_config = ConfigDict(extra="allow", strict=True)


# ---------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``, the body OpenAI returns."""

    error: ErrorInfo


# ---------------------------------------------------------------------- requests
class StreamOptions(OpenAIModel):
    include_usage: bool = False


class _SamplingFields(OpenAIModel):
    """Fields common to both endpoints."""

    model: str
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # Extensions (vLLM's spelling).
    top_k: Optional[int] = Field(default=None, description="Sample from the k most likely tokens; -1 = off.")
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    # vLLM's: mixed into the first block's hash, so the request reuses only prefixes computed
    # with the same salt (a non-empty string; docs/usage.md, "API keys and cache isolation").
    cache_salt: Optional[str] = None
    # Prefill/decode hand-off (vLLM's field name; contents: engine/pd.py KVTransferParams).
    kv_transfer_params: Optional[dict[str, Any]] = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The message's text; content parts are joined (only text parts exist here)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[dict[str, Any]] = None


# ---------------------------------------------------------------------- responses
class CachedTokensByTier(BaseModel):
    """Extension: where the reused prompt KV came from."""

    device: int = 0
    host: int = 0
    storage: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    cached_tokens_by_tier: CachedTokensByTier = Field(default_factory=CachedTokensByTier)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    def add(self, other: "UsageInfo", include_prompt: bool = True) -> None:
        """Sum another choice's usage into this one (n > 1, or a list of prompts).

        As in OpenAI's API, a prompt's tokens count once however many choices (``n``) it
        has: pass ``include_prompt=False`` for the 2nd..nth choice of a prompt.  Its
        cached tokens are then those of the first choice too.
        """
        self.completion_tokens += other.completion_tokens
        if include_prompt:
            self.prompt_tokens += other.prompt_tokens
            mine, theirs = self.prompt_tokens_details, other.prompt_tokens_details
            mine.cached_tokens += theirs.cached_tokens
            for tier in ("device", "host", "storage"):
                setattr(mine.cached_tokens_by_tier, tier,
                        getattr(mine.cached_tokens_by_tier, tier) + getattr(theirs.cached_tokens_by_tier, tier))
        self.total_tokens = self.prompt_tokens + self.completion_tokens


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    # A --splitwise-role prefill server's hand-off for the decode server (engine/pd.py).
    kv_transfer_params: Optional[dict[str, Any]] = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Optional[UsageInfo] = None
    # A --splitwise-role prefill server's hand-off for the decode server (engine/pd.py).
    kv_transfer_params: Optional[dict[str, Any]] = None


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fastdeploy_kvcache"
    max_model_len: Optional[int] = None
    # Extension: the server's --block-size, which the router hashes prompts with.
    block_size: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
