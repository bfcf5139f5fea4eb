"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`~fastdeploy_kvcache.engine.llm_engine.LLMEngine`."""
