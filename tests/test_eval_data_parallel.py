"""Data-parallel lm-eval as users launch it: `accelerate launch --num_processes 2 $(which flexicache) eval lm-eval
--model flexicache ...` on this machine's CPU, against `flexicache eval lm-eval` in one process (run in the test's
process, lm-eval's own tasks left out of its index, as tests/test_eval_lm_eval_tasks.py runs it): same score, same
answers. Tiny model, an invented L-Eval task, FlexiCache really selecting (prompts of ~300 tokens, budget 64).

On a CPU, `accelerate launch --cpu --num_processes 2` starts one process (accelerate starts several CPU processes
only through mpirun); the launch here is `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2`
(torchrun's launcher, gloo), checked to start two. lm-eval 0.4.13's HFLM gives each process its rank only when
`torch.cuda.device_count() > 1`; `FlexiCacheLM` takes it from its accelerator otherwise, so the two processes split
the requests (eval/README.md, "Data-parallel evaluation")."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

from fc_hf.eval import cli  # noqa: E402
from fc_hf.eval.lm_eval_tasks import TASKS_PATH  # noqa: E402
from benchmark_records import records_folder  # noqa: E402

TASK = "multidoc_qa"  # 5 questions on 2 documents: 3 requests for rank 0, 2 for rank 1 when split
BUDGET, MAX_LENGTH, NEW_TOKENS = 64, 400, 6
FILLER = "orchard lighthouse keeper harbour schooner grafting hawthorn plums dairy lens".split()  # in no answer


def _executable(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"no `{name}` executable next to {sys.executable} or on PATH")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(model_folder: Path, data: Path, out: Path) -> list[str]:
    """`flexicache eval lm-eval` arguments, identical for both runs but for --output_path."""
    return ["--model", "flexicache", "--model_args",
            f"pretrained={model_folder},method=flexicache,token_budget={BUDGET},profile={model_folder}/profile.json",
            "--include_path", str(TASKS_PATH), "--tasks", f"leval_{TASK}", "--apply_chat_template",
            "--metadata", json.dumps({"leval_data": str(data), "max_length": MAX_LENGTH}), "--device", "cpu",
            "--gen_kwargs", f"max_gen_toks={NEW_TOKENS}", "--log_samples", "--output_path", str(out)]


def _one_process(args: list[str]) -> None:
    """`flexicache eval lm-eval ARGS` in this process, with lm-eval's own tasks left out of its index (tens of seconds
    to build; as tests/test_eval_lm_eval_tasks.py does it, restoring every binding afterwards)."""
    import importlib
    from functools import partial

    import lm_eval.tasks

    for name in ("lm_eval.evaluator", "lm_eval.evaluator_utils", "lm_eval.api.task", "lm_eval.config.evaluate_config"):
        importlib.import_module(name)
    real = lm_eval.tasks.TaskManager
    with pytest.MonkeyPatch.context() as mp:
        for name, module in list(sys.modules.items()):
            if name.startswith("lm_eval") and getattr(module, "TaskManager", None) is real:
                mp.setattr(module, "TaskManager", partial(real, include_defaults=False))
        assert cli.main(["lm-eval", *args]) == 0


def _read(out: Path) -> tuple[dict, dict]:
    """The run's results entry for the task and its samples by doc_id (lm-eval writes them from rank 0 only)."""
    (results,) = out.rglob("results_*.json")
    (samples,) = out.rglob(f"samples_leval_{TASK}_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines() if line]
    by_id = {r["doc_id"]: r for r in rows}
    assert len(by_id) == len(rows)
    return json.loads(results.read_text())["results"][f"leval_{TASK}"], by_id


def _data_with_references(folder: Path, answers: list[str]) -> Path:
    """The fixture task with the i-th reference made of the i-th answer's words (the first one dropped for odd i)
    and filler words, as many words as the original reference (the prompt asks for "about N words", N the
    reference's word count, so the prompts stay those of the first run): a score strictly between 0 and 1 to which
    the samples contribute differently."""
    src = records_folder() / "leval" / f"{TASK}.jsonl"
    records = [json.loads(line) for line in src.read_text(encoding="utf-8").splitlines() if line]
    i = 0
    for r in records:
        for j, original in enumerate(r["outputs"]):
            words = answers[i].split()[i % 2:]
            r["outputs"][j] = " ".join((words + FILLER)[:len(original.split())])
            i += 1
    assert i == len(answers), "one answer per question"
    folder.mkdir(parents=True)
    (folder / f"{TASK}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def runs(model_folder, tmp_path_factory):
    """One process (in this process) and two processes (`accelerate launch`, a subprocess) on the same data."""
    tmp = tmp_path_factory.mktemp("data_parallel")
    accelerate, flexicache = _executable("accelerate"), _executable("flexicache")

    # The model's answers to the fixture questions (0 F1 for a random model), to make references they partly meet.
    _one_process(_args(model_folder, records_folder() / "leval", tmp / "answers"))
    _, first = _read(tmp / "answers")
    data = _data_with_references(tmp / "data", [first[i]["resps"][0][0] for i in sorted(first)])

    _one_process(_args(model_folder, data, tmp / "one"))
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "LMEVAL_LOG_LEVEL": "INFO"}
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           flexicache, "eval", "lm-eval", *_args(model_folder, data, tmp / "two")]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    print(f"2 processes: {time.perf_counter() - start:.1f} s")
    return {"one": _read(tmp / "one"), "two": _read(tmp / "two"), "log": log}


def test_two_processes_give_the_score_and_answers_of_one(runs):
    one, one_samples = runs["one"]
    two, two_samples = runs["two"]
    # Two processes really ran (each builds the model once), not one: `--cpu` would have started a single one.
    assert runs["log"].count("Initializing flexicache model") == 2, runs["log"][-4000:]
    assert 0 < one["score,none"] < 1  # a real number: answers partly meet their references
    assert two["score,none"] == one["score,none"] and two["score_stderr,none"] == one["score_stderr,none"]
    assert two["sample_len"] == one["sample_len"] == 5
    assert sorted(two_samples) == sorted(one_samples) == list(range(5))  # every question once
    for i, row in one_samples.items():
        other = two_samples[i]
        assert other["doc"] == row["doc"] and other["arguments"] == row["arguments"]  # same prompt
        # The same answer, scored the same. (Split over ranks, lm-eval pads the shorter rank with a copy of its last
        # request and appends that copy's answer to the instance's resps: compare the first, and what is scored.)
        assert other["resps"][0][0] == row["resps"][0][0] and other["filtered_resps"] == row["filtered_resps"]
        assert other["score"] == row["score"]
    assert len({row["score"] for row in one_samples.values()}) > 1  # answers given to the wrong question would show


def test_two_processes_split_the_requests(runs):
    ranks = set(re.findall(rf"Building contexts for leval_{TASK} on rank (\d+)", runs["log"]))
    assert ranks == {"0", "1"}
