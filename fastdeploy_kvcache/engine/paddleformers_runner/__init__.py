"""The paddleformers runner (``--model-impl paddleformers``): ``PaddleModelRunner`` and what only it uses.

Paddle and paddleformers are imported here, and lazily (inside functions) by the shared engine
modules that load a Paddle model; nothing here imports torch or ``transformers_runner``.
"""
