"""The check every fla-family CPU test makes of its model's cache: a text fed as a chunked prefill (successive
slices through one fla Cache), then one token per call, gives the logits of one full forward."""

from __future__ import annotations

import torch
from fla.models.utils import Cache

# slices above 64 tokens run the chunk kernels, slices <= 64 the recurrent ones
CHUNKED_PREFILL = ((0, 70), (70, 100), (100, 150))


def prefill_then_decode(model, ids: torch.Tensor, prefill=CHUNKED_PREFILL) -> tuple[torch.Tensor, Cache]:
    """(logits of every position of `ids`, the cache): the `prefill` slices (start, end) through one Cache, then
    one token per call from the last slice's end; each call must return that same Cache."""
    cache = Cache()
    pieces = []
    with torch.no_grad():
        for start, end in prefill:
            out = model(ids[:, start:end], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache
            pieces.append(out.logits)
        for t in range(prefill[-1][1], ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache
            pieces.append(out.logits)
    assert cache.get_seq_length() == ids.shape[1]
    return torch.cat(pieces, 1), cache
