"""torch.ops.exl3.embedding: rows of a quantized token embedding, decoded on lookup (torch ops on any device)."""

from __future__ import annotations

import torch

from ..format import embedding as emb
from . import library


def _embedding(ids: torch.Tensor, trellis: torch.Tensor, signs: torch.Tensor, values_of: torch.Tensor,
               hidden: int) -> torch.Tensor:
    """fp16 [*ids.shape, hidden]: the decoded rows of the table for `ids` (opaque to torch.compile)."""
    flat = ids.reshape(-1)
    return emb.decode_rows(trellis.index_select(0, flat), signs, hidden, values_of).reshape(*ids.shape, hidden)


def _embedding_fake(ids, trellis, signs, values_of, hidden):
    return trellis.new_empty((*ids.shape, hidden), dtype=torch.float16)


embedding = library.define("embedding", _embedding, _embedding_fake)
