"""Scheduler side: pure Python, never imports Paddle or CuPy (enforced by a test)."""
