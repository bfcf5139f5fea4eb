"""What both runners' attention functions share: the step they attend over and their registration.

Neither model library passes the engine's step to the attention layers, so each runner sets
its step object (paddleformers: ``paddleformers_runner.attention.StepContext``; transformers:
``transformers_runner.torch_attention.TorchStep``) with :class:`step_context` around the
forward pass, and its attention function reads it back with :func:`current_context`.  Both
libraries offer the same hook for a custom attention function, ``AttentionInterface``, which
:func:`select_attention` registers with once per process.  Nothing here imports a model
library: the runner passes in the function that does.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

_local = threading.local()


class step_context:
    """``with step_context(ctx): model(...)`` makes ``ctx`` visible to the attention function.

    Thread-local, so two engines in one process (tests) never see each other's step.
    """

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def __enter__(self) -> Any:
        self.prev = getattr(_local, "ctx", None)
        _local.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc: Any) -> None:
        _local.ctx = self.prev


def current_context() -> Any:
    """The step set by the innermost :class:`step_context` of this thread."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("paged attention called outside an engine step (no step context set)")
    return ctx


_registered: set[str] = set()
_register_lock = threading.Lock()


def select_attention(config: Any, name: str, interface: Callable[[], Any], function: Callable[..., Any]) -> None:
    """Register ``function`` as attention ``name`` with the model library's
    ``AttentionInterface`` (``interface()`` imports it; once per process) and select it in
    ``config``: the one hook both model libraries (paddleformers, transformers) offer."""
    with _register_lock:
        if name not in _registered:
            interface().register(name, function)
            _registered.add(name)
    config._attn_implementation = name
