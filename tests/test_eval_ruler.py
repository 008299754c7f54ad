"""RULER with a shared prefill gives what lm-eval's own loop gives, on lm-eval's own samples."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

pytest.importorskip("lm_eval")
pytest.importorskip("wonderwords")

from test_eval_lm_eval import word_tokenizer  # noqa: E402

from fc_hf.eval import ruler  # noqa: E402


def _rows(root, method):
    path = root / "ruler" / "tiny" / "niah_single_1-256" / method / "predictions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_shared_prefill_answers_equal_lm_eval_route(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    tok = word_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    bundle = (model, tok, str(tmp_path / "tok"))
    common = dict(seq_lengths=(256,), limit=2, model_bundle=bundle)
    ruler.run_ruler("tiny", ["niah_single_1"], ["dense", "quest"], [32], tmp_path / "shared", **common)
    ruler.run_ruler("tiny", ["niah_single_1"], ["dense", "quest"], [32], tmp_path / "lm_eval", shared_prefill=False, **common)
    for method in ("dense", "quest-b32"):
        shared, own = _rows(tmp_path / "shared", method), _rows(tmp_path / "lm_eval", method)
        assert len(shared) == 2
        assert [(r["id"], r["target"], r["response"], r["score"]) for r in shared] == \
               [(r["id"], r["target"], r["response"], r["score"]) for r in own]
        assert all(r["prompt_tokens"] > 2 * 32 for r in shared)  # more than the budget: quest drops pages
    # resuming finds every sample done and appends nothing
    ruler.run_ruler("tiny", ["niah_single_1"], ["dense", "quest"], [32], tmp_path / "shared", **common)
    assert len(_rows(tmp_path / "shared", "quest-b32")) == 2
