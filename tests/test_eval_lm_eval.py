"""The lm-eval model type `flexicache`: registered, and every generate call gets a fresh cache."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

pytest.importorskip("lm_eval")

from lm_eval.api.registry import get_model  # noqa: E402

from fc_hf.eval.lm_eval_model import FlexiCacheLM  # noqa: E402


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3}
    for w in "the a cat dog sat on mat and then ran far away is was here there".split():
        vocab[w] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


def test_registered_under_flexicache():
    assert get_model("flexicache") is FlexiCacheLM


@pytest.mark.parametrize("method", ["dense", "quest", "no-rerank"])
def test_each_generate_gets_a_fresh_cache_and_matches_dense_within_budget(tiny, method):
    tok = word_tokenizer()
    lm = FlexiCacheLM(pretrained=tiny, tokenizer=tok, method=method, token_budget=64, batch_size=1)
    made = []
    real_generate = tiny.generate

    def spy(*args, **kwargs):
        made.append(kwargs.get("cache", kwargs.get("past_key_values")))
        return real_generate(*args, **kwargs)

    tiny.generate = spy
    try:
        ctx = torch.tensor([tok("the cat sat on the mat and then the dog ran far away")["input_ids"]])
        outs = [lm._model_generate(ctx, max_length=ctx.shape[1] + 6, stop=[], do_sample=False) for _ in range(2)]
    finally:
        del tiny.generate
    assert outs[0].shape == (1, ctx.shape[1] + 6)
    if method == "dense":
        assert made == [None, None] and lm.caches_made == 0
    else:
        assert lm.caches_made == 2 and made[0] is not made[1]
        assert all(type(c).__name__ == "FlexiCache" for c in made)
        # 13 + 6 tokens < the 64-token budget: every page is selected, so the output equals dense.
        from fc_hf.eval.methods import prepare_model

        prepare_model(tiny, "dense")
        dense = tiny.generate(input_ids=ctx, max_length=ctx.shape[1] + 6, do_sample=False, pad_token_id=0)
        assert torch.equal(outs[0], dense) and torch.equal(outs[1], dense)


def test_flexicache_method_requires_a_profile(tiny, tmp_path):
    from fc_hf.profile import HeadProfile

    tok = word_tokenizer()
    with pytest.raises(ValueError, match="needs a head profile"):
        FlexiCacheLM(pretrained=tiny, tokenizer=tok, method="flexicache", token_budget=64, batch_size=1)
    path = HeadProfile.from_unstable(tiny.config, [(0, 1)]).save(tmp_path / "p.json")
    lm = FlexiCacheLM(pretrained=tiny, tokenizer=tok, method="flexicache", token_budget=64, batch_size=1, profile=str(path))
    assert lm.profile.unstable == {(0, 1)}
    ctx = torch.tensor([tok("the cat sat")["input_ids"]])
    assert lm._model_generate(ctx, max_length=6, stop=[], do_sample=False).shape == (1, 6)
    assert lm.caches_made == 1


def test_unknown_method_rejected(tiny):
    with pytest.raises(ValueError, match="Unknown method"):
        FlexiCacheLM(pretrained=tiny, tokenizer=word_tokenizer(), method="h2o")

