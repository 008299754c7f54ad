"""lm-eval task configs for L-Eval and LongBench (eval/lm_eval_tasks/): every task is on the include path, and
lm-eval's command line (`flexicache eval lm-eval`, `--model hf` and `--model flexicache`) gives the same answers as
`flexicache eval leval|longbench` for the same samples (tiny model, fixture files, no network)."""

import json
from functools import partial
from pathlib import Path

import pytest
import yaml

pytest.importorskip("lm_eval")

from fc_hf.eval import cli, generation, leval, longbench  # noqa: E402
from fc_hf.eval.lm_eval_tasks import TASKS_PATH  # noqa: E402
from benchmark_records import records_folder  # noqa: E402

FIXTURES = records_folder()  # invented L-Eval / LongBench records, written to a temporary folder
BUDGET = 64  # tokens per head: 4 pages of 16, far below the prompts' ~300 tokens, so FlexiCache really selects
MAX_LENGTH = 400  # prompt tokens: the fixture documents (~410 tokens) are cut in the middle


def _task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=False, include_path=str(TASKS_PATH))


def test_include_path_holds_one_task_per_benchmark_task_and_the_groups(capsys):
    assert cli.main(["tasks-path"]) == 0 and capsys.readouterr().out.strip() == str(TASKS_PATH)
    tm = _task_manager()
    assert set(tm.all_subtasks) == {f"leval_{t}" for t in leval.TASKS} | {
        f"flexicache_longbench_{t}" for t in longbench.PROMPTS}
    assert set(tm.all_groups) == {"leval", "leval_open", "leval_exam", "flexicache_longbench"}
    for task in leval.TASKS:  # each config names its task and that task's generation length
        cfg = yaml.safe_load((TASKS_PATH / "leval" / f"leval_{task}.yaml").read_text())
        assert cfg["dataset_kwargs"] == {"leval_task": task}
        assert cfg["generation_kwargs"]["max_gen_toks"] == leval.MAX_NEW_TOKENS[task]
    for task in longbench.PROMPTS:
        cfg = yaml.safe_load((TASKS_PATH / "longbench" / f"flexicache_longbench_{task}.yaml").read_text())
        assert cfg["dataset_kwargs"] == {"longbench_task": task}
        assert cfg["generation_kwargs"]["max_gen_toks"] == longbench.MAX_NEW_TOKENS[task]


def test_hook_without_data_says_how_to_pass_it(tmp_path):
    from fc_hf.eval.lm_eval_tasks import leval_dataset

    with pytest.raises(RuntimeError, match='"leval_data"'):
        leval_dataset("tpo", leval_data=str(tmp_path), tokenizer="unused")


def _lm_eval(monkeypatch, out: Path, model: str, model_args: str, tasks: str, limit: int):
    """lm-eval's command line through `flexicache eval lm-eval`; lm-eval's own tasks are left out of its index,
    which otherwise takes tens of seconds to build. Returns {task: {sample id: answer}} and the prompts."""
    import importlib
    import sys

    import lm_eval.tasks

    # Import the modules that bind TaskManager at import time *before* patching, and patch every binding, so
    # monkeypatch restores them all: a module first imported under the patch would keep the restricted index
    # for the rest of the session (seen: the RULER tests then found no niah_single_1).
    for name in ("lm_eval.evaluator", "lm_eval.evaluator_utils", "lm_eval.api.task", "lm_eval.config.evaluate_config"):
        importlib.import_module(name)
    real = lm_eval.tasks.TaskManager
    restricted = partial(real, include_defaults=False)
    for name, module in list(sys.modules.items()):
        if name.startswith("lm_eval") and getattr(module, "TaskManager", None) is real:
            monkeypatch.setattr(module, "TaskManager", restricted)
    metadata = {"leval_data": str(FIXTURES / "leval"), "longbench_data": str(FIXTURES / "longbench"),
                "max_length": MAX_LENGTH}
    assert cli.main(["lm-eval", "--model", model, "--model_args", model_args, "--include_path", str(TASKS_PATH),
                     "--tasks", tasks, "--metadata", json.dumps(metadata), "--apply_chat_template", "--device", "cpu",
                     "--limit", str(limit), "--gen_kwargs", "max_gen_toks=6", "--log_samples",
                     "--output_path", str(out)]) == 0
    answers, prompts = {}, {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name[len("samples_"):].rsplit("_", 1)[0]
        for row in (json.loads(line) for line in f.read_text(encoding="utf-8").split("\n") if line):
            doc = row["doc"]
            sid = doc["_id"] if "_id" in doc else f"{doc['doc_index']}-{doc['inst_index']}"
            answers.setdefault(task, {})[sid] = row["resps"][0][0]
            prompts.setdefault(task, {})[sid] = row["arguments"]["gen_args_0"]["arg_0"]
    return answers, prompts


def _harness_answers(out: Path, bench: str, model: str, task: str, run: str) -> dict[str, str]:
    path = out / bench / model / task / run / "predictions.jsonl"
    rows = (json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line)
    return {r["id"]: r["prediction"] for r in rows}


def test_lm_eval_route_gives_the_answers_of_flexicache_eval(model_folder, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_folder)
    folder, limit = str(model_folder), 2  # 2 questions on one document per L-Eval task
    dense, prompts = _lm_eval(monkeypatch, tmp_path / "hf", "hf", f"pretrained={folder}",
                              "leval_multidoc_qa,leval_quality,flexicache_longbench_hotpotqa", limit)
    sparse, _ = _lm_eval(monkeypatch, tmp_path / "fc", "flexicache",
                         f"pretrained={folder},method=flexicache,token_budget={BUDGET},profile={folder}/profile.json",
                         "leval_multidoc_qa,leval_quality", limit)

    out = tmp_path / "harness"
    generation.run_leval(folder, ["multidoc_qa", "quality"], ["dense", "flexicache"], [BUDGET], out,
                         data=str(FIXTURES / "leval"), limit=limit, max_prompt_tokens=MAX_LENGTH, max_new_tokens=6,
                         profile_arg=str(model_folder / "profile.json"))
    generation.run_longbench(folder, ["hotpotqa"], ["dense"], [BUDGET], out, data=str(FIXTURES / "longbench"),
                             limit=limit, max_prompt_tokens=MAX_LENGTH, max_new_tokens=6)
    samples = leval.load_leval("multidoc_qa", local=FIXTURES / "leval", tokenizer=tok, max_length=MAX_LENGTH)
    assert "Martha" in samples[0]["prompt"] and "1923" not in samples[0]["prompt"]  # head and tail of the document
    for task in ("multidoc_qa", "quality"):
        assert dense[f"leval_{task}"] == _harness_answers(out, "leval", model_folder.name, task, "dense")
        assert sparse[f"leval_{task}"] == _harness_answers(out, "leval", model_folder.name, task, f"flexicache-b{BUDGET}")
        assert len(dense[f"leval_{task}"]) == limit
        for s in leval.load_leval(task, local=FIXTURES / "leval", tokenizer=tok, max_length=MAX_LENGTH, limit=limit):
            lm_prompt = prompts[f"leval_{task}"][f"{s['doc_index']}-{s['inst_index']}"]
            assert tok(lm_prompt)["input_ids"] == leval.prompt_ids(tok, s)
            assert len(leval.prompt_ids(tok, s)) > 3 * BUDGET
    assert dense["flexicache_longbench_hotpotqa"] == _harness_answers(out, "longbench", model_folder.name, "hotpotqa", "dense")
