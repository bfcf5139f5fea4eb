"""The transformers runner (``--model-impl transformers``): ``TorchModelRunner`` and what only it uses.

Its paged attention (``torch_attention``, the Triton kernels of ``triton_paged_attention``), the
decode steps replayed from CUDA graphs (``decode_graphs``), fused decoder layers (``torch_fused``),
sampling on the device (``torch_sampling``), the torch models (``torch_models``) and the device
memory profile (``gpu_memory``).  Nothing here imports Paddle or ``paddleformers_runner``; the
package is named after the model library so that it never reads as the ``torch`` package.
"""
