"""fastdeploy_kvcache: a tiered KV-cache manager for LLM serving on PaddlePaddle.

The package splits into a scheduler side (``core``: pure Python, no Paddle/CuPy import)
and a worker side (``worker``: memory, streams, copy ops).  Importing the top-level
package must stay cheap, so nothing heavy is imported here.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
