"""Token sampling on the device for the transformers runner.

The host path (:func:`~fastdeploy_kvcache.engine.sampling.sample_row`) is the reference; this
does the same steps on a ``[rows, vocab]`` logits tensor, so that a step brings back only
the int64 token ids instead of the float logits (for 64 rows of a 128k vocabulary, 32 MB
over the link and an argmax or sort on the host per row).

Per sampling row: divide by the temperature, sort descending (stable, so ties go by id as
on the host), keep the first ``top_k``, renormalise, keep the shortest head whose
probability reaches ``top_p``, and pick the first candidate whose normalised cumulative
probability passes the row's uniform draw ``u``.  The draw comes from the request's own RNG
on the host (:class:`~fastdeploy_kvcache.engine.sampling.StepSampling`), so a seeded request
gives the same tokens on either path, up to float rounding where ``u`` falls within about
1e-15 of a boundary (the device works in float64 too).  Greedy rows take the argmax.
"""

from __future__ import annotations

from typing import Any

from fastdeploy_kvcache.engine.sampling import StepSampling


def sample_on_device(torch: Any, logits: Any, sampling: StepSampling, packed: Any) -> Any:
    """The int64 token id of each row of ``logits`` (a device tensor ``[R, vocab]``).

    ``packed`` is ``sampling.packed()`` already on the logits' device (one upload; None
    when every row is greedy).
    Launches kernels only: nothing here waits for the device.
    """
    if logits.shape[0] != len(sampling):
        raise ValueError(f"logits: {logits.shape[0]} rows for {len(sampling)} sampling rows")
    ids = logits.argmax(dim=-1)
    m = len(sampling.sampled_rows)
    if m == 0:
        return ids
    rows = packed[:m]
    top_k = packed[m:2 * m]
    temperature, top_p, u = packed[2 * m:5 * m].view(torch.float64).view(3, m)
    vocab = logits.shape[1]
    x = logits.index_select(0, rows).double() / temperature[:, None]
    vals, order = torch.sort(x, dim=-1, descending=True, stable=True)
    probs = torch.exp(vals - vals[:, :1])
    col = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab)
    probs.masked_fill_(col[None, :] >= k[:, None], 0.0)
    probs.div_(probs.sum(dim=-1, keepdim=True))
    cum = probs.cumsum(dim=-1)
    keep = torch.searchsorted(cum, top_p[:, None].contiguous(), side="left") + 1
    keep = torch.where(top_p[:, None] < 1.0, keep, vocab)
    probs.masked_fill_(col[None, :] >= keep, 0.0)
    cdf = probs.cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]  # not in place: the divisor is a view of cdf
    pick = torch.searchsorted(cdf, u[:, None].contiguous(), side="right").clamp_(max=vocab - 1)
    return ids.index_copy(0, rows, order.gather(1, pick).squeeze(1))
