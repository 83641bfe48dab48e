"""The running batch: one left-padded KV cache shared by every active sequence.

Row i of the batch holds sequence i's keys and values right-aligned in a [B, heads, L, d]
cache; `mask` [B, L] is 1 on real positions and 0 on left padding, and `positions` [B] is
each row's next position id (its real length), so a padded row computes exactly what it
would alone. Sequences join after their own unpadded prefill (`prefill`) by left-padding
both sides to a common length (`merge`), and leave by row selection (`keep`), which also
drops columns that became padding in every row. One decode step is one forward over all
rows. The cache is an HF DynamicCache whose per-layer tensors this module rewrites on
join and leave.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaForCausalLM

# transformers 5.x renamed `past_key_values` to `cache` (input and output); support both.
CACHE = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


class DecodeBatch:
    def __init__(self, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor, last: torch.Tensor):
        self.cache = cache  # layers' keys/values [B, kv_heads, L, head_dim]
        self.mask = mask  # int64 [B, L]
        self.positions = positions  # int64 [B]
        self.last = last  # int64 [B], the token each row feeds next

    @property
    def size(self) -> int:
        return self.mask.shape[0]

    def set_last(self, tokens: list[int]) -> None:
        self.last = torch.tensor(tokens, dtype=torch.long)

    def step(self, model) -> torch.Tensor:
        """One decode forward over all rows; returns next-token logits [B, V] (model dtype)."""
        mask = torch.cat([self.mask, torch.ones(self.size, 1, dtype=torch.long)], dim=1)
        out = model(
            input_ids=self.last.view(-1, 1),
            attention_mask=mask,
            position_ids=self.positions.view(-1, 1),
            use_cache=True,
            **{CACHE: self.cache},
        )
        self.cache, self.mask = out[CACHE], mask
        self.positions = self.positions + 1
        return out.logits[:, -1, :]

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order), then trim columns that are padding everywhere."""
        index = torch.tensor(rows, dtype=torch.long)
        self.mask, self.positions, self.last = self.mask[index], self.positions[index], self.last[index]
        start = int(self.mask.any(dim=0).long().argmax()) if self.size else 0
        self.mask = self.mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]

    @staticmethod
    def merge(parts: list["DecodeBatch"]) -> "DecodeBatch":
        """Stack batches row-wise, left-padding each to the longest."""
        if len(parts) == 1:
            return parts[0]
        length = max(p.mask.shape[1] for p in parts)
        cache = parts[0].cache
        for i, layer in enumerate(cache.layers):
            for name in ("keys", "values"):
                # F.pad pads the last dims first: (head_dim left, right, seq left, right).
                tensors = [F.pad(getattr(p.cache.layers[i], name), (0, 0, length - p.mask.shape[1], 0)) for p in parts]
                setattr(layer, name, torch.cat(tensors, dim=0))
        mask = torch.cat([F.pad(p.mask, (length - p.mask.shape[1], 0)) for p in parts], dim=0)
        return DecodeBatch(
            cache,
            mask,
            torch.cat([p.positions for p in parts]),
            torch.cat([p.last for p in parts]),
        )


def prefill(model, prompt_ids: list[int], all_logits: bool) -> tuple[DecodeBatch, torch.Tensor]:
    """Run one prompt alone; returns its one-row batch and logits [P or 1, V] (model dtype)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=0 if all_logits else 1)
    n = len(prompt_ids)
    batch = DecodeBatch(
        out[CACHE],
        torch.ones(1, n, dtype=torch.long),
        torch.tensor([n], dtype=torch.long),
        torch.zeros(1, dtype=torch.long),
    )
    return batch, out.logits[0]
