"""Network entry points: the OpenAI-compatible HTTP server and the ``fastdeploy-kvcache`` CLI."""
