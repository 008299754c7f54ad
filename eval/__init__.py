"""FlexiCache's accuracy harness (installed as `fc_hf.eval`; `flexicache eval`). See `README.md` in this folder.

| module | owns |
|---|---|
| `cli.py` | `flexicache eval`: one table row (`SUBCOMMANDS`) per subcommand |
| `methods.py` | the compared methods: a cache and attention implementation per method name, method@budget runs, cache options; the one module the benchmarks (`bench/`) share |
| `results.py` | one resumable results folder per configuration |
| `profile_choice.py` | the head profile a task runs with, made without that task's material |
| `loading.py` | the model a run uses (bundled name or folder, dtype) |
| `shared_prefill.py` | one dense prefill per sample, handed to every method's cache; prefix reuse across a document's questions |
| `fidelity.py` | teacher-forced fidelity against dense: tasks, comparison, run loop |
| `freerun.py` | free-running greedy continuations: repeated-4-gram rate and first divergence vs dense, bootstrap summary |
| `ruler.py` | RULER through lm-eval's tasks: shared-prefill loop and lm-eval's own loop |
| `generation.py` | LongBench / L-Eval run loop: greedy answers, scored per sample |
| `longbench.py`, `leval.py`, `sources.py`, `metrics.py` | those benchmarks' data, prompts and metrics |
| `prompts.py` | prompt text -> token ids as lm-eval encodes them; middle truncation |
| `lm_eval_model.py` | the `flexicache` model type for lm-eval |
| `lm_eval_tasks/` | lm-eval task configs (YAML + hooks) for L-Eval and LongBench on local data (`flexicache eval tasks-path`) |
| `summary.py` | retention / fidelity tables and plots of a results tree |
| `agreement.py` | per-question agreement with dense's answers and retention, with paired bootstrap intervals |

The speed and memory benchmarks are the subpackage `bench/` (`flexicache bench`); the harness never
imports it. A generation one-liner with its own cache, emptied for every call, is the core's
`fc_hf.flexicache_pipeline`.
"""
