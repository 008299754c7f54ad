"""Fidelity task construction and measurement (teacher forcing) on a tiny random model."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fc_hf.eval import fidelity as F

TEXT = "".join(f"verse {i} and the words of line {i} were written down. " for i in range(400))


class CharTokenizer:
    """One token per character (ids are code points below 256)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 256 for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def text_tokens(tokenizer, n, offset):
    return tokenizer(TEXT[offset:offset + n])["input_ids"]


def test_continue_task_is_the_true_continuation():
    tok = CharTokenizer()
    (task,) = F.make_tasks(tok, kinds=("continue",), prompt_tokens=300, forced_tokens=40, offsets=(7,), text_tokens=text_tokens)
    assert task.kind == "continue" and task.name == "continue-o7"
    assert len(task.prompt_ids) == 300 and len(task.target_ids) == 41
    assert task.prompt_ids + task.target_ids == text_tokens(tok, 341, 7)


def test_recall_task_repeats_a_passage_from_distance_back():
    tok = CharTokenizer()
    tasks = F.make_tasks(tok, kinds=("recall",), prompt_tokens=400, forced_tokens=50, distances=(100, 250),
                         text_tokens=text_tokens)
    assert [t.name for t in tasks] == ["recall-d100-o0", "recall-d250-o0"]
    for t, d in zip(tasks, (100, 250)):
        start = t.meta["passage_start"]
        document = text_tokens(tok, 400, 0)
        assert t.target_ids == document[start:start + 51]  # the passage is copied from the document itself
        assert t.prompt_ids[:start + 51] == document[:start + 51]
        cue = tok.decode(t.target_ids[:8]).strip()
        assert tok.decode(t.prompt_ids).endswith(F.RECALL_INSTRUCTION.format(cue=cue))
        assert abs(len(t.prompt_ids) - 400) <= 2 and t.meta["prompt_tokens"] == len(t.prompt_ids)
        # the passage starts `distance` tokens before the instruction
        instr = len(tok(F.RECALL_INSTRUCTION.format(cue=cue))["input_ids"])
        assert len(t.prompt_ids) - instr - start == d


def test_recall_distance_must_fit():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="recall distance"):
        F.make_tasks(tok, kinds=("recall",), prompt_tokens=200, forced_tokens=50, distances=(30,), text_tokens=text_tokens)
    with pytest.raises(ValueError, match="recall distance"):
        F.make_tasks(tok, kinds=("recall",), prompt_tokens=200, forced_tokens=50, distances=(500,), text_tokens=text_tokens)
    with pytest.raises(ValueError, match="No fidelity tasks"):
        F.make_tasks(tok, kinds=("poem",), text_tokens=text_tokens)


def test_forced_logprobs_match_one_full_forward():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    task = F.FidelityTask("t", "continue", ids[:45], ids[45:])
    steps = torch.stack(list(F.forced_logprobs(model, task)))
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([ids[:59]])).logits[0].float(), -1)
    assert steps.shape == (14, 64)
    torch.testing.assert_close(steps, full[45:59], atol=1e-5, rtol=1e-5)


def test_compare_steps_values():
    dense = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0]]), -1)
    method = [torch.log_softmax(torch.tensor([1.0, 2.0, 0.0]), -1), dense[1].clone()]
    out = F.compare_steps(dense, iter(method), targets=[0, 2])
    assert out["agree"] == [0, 1]
    assert out["dense_correct"] == [1, 0] and out["method_correct"] == [0, 0]
    p = dense[0].exp()
    expected = float((p * (dense[0] - method[0])).sum())
    assert out["kl"][0] == pytest.approx(expected) and expected > 0
    assert out["kl"][1] == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(RuntimeError):
        F.compare_steps(dense, iter(method[:1]), targets=[0, 2])


def test_agreement_length_and_summary():
    assert F.agreement_length([1, 2, 3], [1, 2, 4]) == 2
    assert F.agreement_length([1, 2], [1, 2, 3]) == 2
    assert F.agreement_length([], [1]) == 0
    rows = [
        {"kind": "recall", "agree": [1, 0], "kl": [0.0, 1.0], "method_correct": [1, 0], "dense_correct": [1, 1],
         "free_run_agreement": 4},
        {"kind": "continue", "agree": [1, 1], "kl": [0.0, 0.0], "method_correct": [1, 1], "dense_correct": [1, 1],
         "free_run_agreement": None},
    ]
    s = F.summarize(rows)
    assert s["recall"]["agreement"] == 0.5 and s["continue"]["agreement"] == 1.0
    assert s["all"]["agreement"] == 0.75 and s["all"]["kl"] == 0.25 and s["all"]["steps"] == 4
    assert s["all"]["free_run_agreement"] == 4 and "free_run_agreement" not in s["continue"]
    assert math.isnan(F.summarize([])["all"]["agreement"])
