"""Layout rules: the core imports only the core, nothing in it installs anything, eval apart from bench.

- Core = every module directly in `fc_hf/` except the entry points `demo.py` and `cli.py`, plus
  `kernels/` (which the core imports). Importing it (fresh interpreter) loads no provisioning
  (`fc_hf.assets`), profiler, evaluation, demo or command-line module, and no core source imports
  one of them, even inside a function.
- No core source starts a process or names pip, but for one: `kernels/native_ops.py` runs the C++ compiler on its own
  source (`csrc/native_ops.cpp`), once per machine, as torch's `cpp_extension` did for it until 2026-12-07.
- The accuracy harness (`eval/*.py`) never imports the benchmarks (`eval/bench/`); the benchmarks
  import from the harness only `eval/methods.py`, the module they share.
- No module imports another module's private (underscore) name, and no modules import each other (not even
  through an import inside a function).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE_SOURCES = sorted(p for p in (ROOT / "fc_hf").glob("*.py") if p.stem not in ("demo", "cli")) + sorted(
    (ROOT / "kernels").glob("*.py"))
CORE_MODULES = [f"fc_hf.{p.stem}" for p in CORE_SOURCES if p.parent.name == "fc_hf" and p.stem != "__init__"]
NOT_CORE = ("fc_hf.assets", "fc_hf.profiler", "fc_hf.eval", "fc_hf.demo", "fc_hf.cli")
HARNESS = sorted((ROOT / "eval").glob("*.py"))
BENCH = sorted((ROOT / "eval" / "bench").glob("*.py"))


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("kernels", "eval"):
        parts.insert(0, "fc_hf")
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts)
    return ".".join(parts[:-1])


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, imported names) of every import in `path`, at any depth."""
    found = []
    package = _package_of(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names = [a.name for a in node.names]
            found.append((module, names))
            found += [(f"{module}.{n}", []) for n in names]  # `from pkg import submodule`
    return found


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_importing_the_core_loads_no_provisioning_profiler_eval_demo_or_cli():
    code = (
        "import importlib, json, sys\n"
        f"for name in {CORE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert {"fc_hf.cache", "fc_hf.attention", "fc_hf.layer"} <= set(loaded)
    assert [m for m in loaded if _under(m, NOT_CORE)] == []


def test_core_sources_import_only_the_core():
    bad = [(p.name, m) for p in CORE_SOURCES for m, _ in imports(p) if _under(m, NOT_CORE)]
    assert bad == []


PROCESS_MODULES = ("subprocess", "pip", "multiprocessing")


def test_core_never_starts_a_process_or_names_pip():
    bad = []
    for path in CORE_SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                starters = ("pip", "multiprocessing") if path.name == "native_ops.py" else PROCESS_MODULES
                bad += [(path.name, m) for m in mods if m.split(".")[0] in starters]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
                if re.fullmatch(r"system|popen|exec\w*|spawn\w*|fork\w*", node.attr):
                    bad.append((path.name, f"os.{node.attr}"))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.search(r"\bpip\b", node.value):
                    bad.append((path.name, node.value[:60]))
    assert bad == []


def test_harness_and_benchmarks_meet_only_in_methods():
    harness_imports_bench = [(p.name, m) for p in HARNESS
                             for m, _ in imports(p) if _under(m, ["fc_hf.eval.bench"])]
    assert harness_imports_bench == []
    harness = {f"fc_hf.eval.{p.stem}" for p in HARNESS} - {"fc_hf.eval.__init__"}
    bench_uses = {m for p in BENCH for m, _ in imports(p) if m in harness}
    assert bench_uses <= {"fc_hf.eval.methods"}


def test_no_module_imports_another_modules_private_names():
    bad = []
    for path in CORE_SOURCES + HARNESS + BENCH + sorted((ROOT / "fc_hf").glob("*/*.py")):
        for module, names in imports(path):
            if module and module.startswith("fc_hf"):
                bad += [(path.relative_to(ROOT).as_posix(), f"{module}.{n}") for n in names
                        if n.startswith("_") and not n.startswith("__")]
    assert bad == []


def test_no_import_cycles_even_through_function_level_imports():
    sources = sorted((ROOT / "fc_hf").rglob("*.py")) + sorted((ROOT / "eval").rglob("*.py")) + sorted(
        (ROOT / "kernels").glob("*.py"))
    modules = {}
    for path in sources:
        name = _package_of(path) if path.stem == "__init__" else f"{_package_of(path)}.{path.stem}"
        modules[name] = path
    graph = {name: {m for m, _ in imports(path) if m in modules and m != name and not name.startswith(m + ".")}
             for name, path in modules.items()}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    cycles = [c for c in map(cycle_from, sorted(graph)) if c]
    assert cycles == []
