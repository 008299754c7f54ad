"""Helpers of the robustness tests (issue 8): a recording cache, teacher forcing, a tiny tokenizer."""

from __future__ import annotations

import torch

from fc_hf.cache import FlexiCache


class RecordingCache(FlexiCache):
    """A FlexiCache that also keeps every K/V given to `update`, as a DynamicCache fed the same states would
    (beam reorders and batch expansion included)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.seen.get(layer_idx, (None, None))
        self.seen[layer_idx] = (
            key_states.clone() if k is None else torch.cat([k, key_states], 2),
            value_states.clone() if v is None else torch.cat([v, value_states], 2),
        )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _reindex_seen(self, rows: torch.Tensor) -> None:
        self.seen = {i: (k[rows.to(k.device)], v[rows.to(v.device)]) for i, (k, v) in self.seen.items()}

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._reindex_seen(beam_idx)

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self._reindex_seen(indices)

    def batch_repeat_interleave(self, repeats):
        super().batch_repeat_interleave(repeats)
        if self.seen:
            batch = next(iter(self.seen.values()))[0].shape[0]
            self._reindex_seen(torch.arange(batch).repeat_interleave(repeats))

    def assert_nothing_lost(self, where: str = "") -> None:
        """Both tiers together hold every token's K/V bit for bit, in every FlexiCache layer."""
        for idx, layer in enumerate(self.layers):
            if not hasattr(layer, "dense_kv"):
                continue
            k, v = layer.dense_kv()
            assert torch.equal(k, self.seen[idx][0]), f"{where} layer {idx}: keys differ"
            assert torch.equal(v, self.seen[idx][1]), f"{where} layer {idx}: values differ"


def forced_decode(model, cache, ids, mask, forced, on_step=None) -> torch.Tensor:
    """Prefill `ids`, then teacher-force `forced [B, T]` one token at a time; returns logits `[B, T, V]`.

    Positions come from the attention mask as in `generate` (left padding does not shift RoPE).
    """
    logits = []
    with torch.no_grad():
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        for t in range(forced.shape[1]):
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], 1)
            pos = mask.sum(1, keepdim=True) - 1
            out = model(input_ids=forced[:, t : t + 1], attention_mask=mask, position_ids=pos, past_key_values=cache,
                        use_cache=True)
            logits.append(out.logits[:, -1])
            if on_step is not None:
                on_step(t)
    return torch.stack(logits, 1)


def tiny_tokenizer(vocab: int = 97):
    """A word-level fast tokenizer over `vocab` tokens: "<pad>"=0, "</s>"=1, "<unk>"=2, then "w3" ... "w{vocab-1}".

    One extra word, "abcdef" (id `vocab`, never generated), lets transformers' stop-string matching
    probe token texts the way it does with real tokenizers.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab)}, "abcdef": vocab}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", padding_side="left"
    )


def words(ids) -> str:
    """Text of token ids for `tiny_tokenizer`."""
    return " ".join(f"w{int(i)}" for i in ids)
