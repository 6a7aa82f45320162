"""Where the weights come from: resolves `--model` before any port opens.

A Hugging Face checkpoint directory, a `.gguf` file, or the short name of a packaged
model. Anything else fails with a `ModelSourceError` that names what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pypto_serving.app.packaged_models import SHORT_NAMES, PackagedModelMissing, resolve_short_name
from pypto_serving.loader.arch import ModelArch


class ModelSourceError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ModelSource:
    path: Path
    format: str  # "hf" or "gguf"
    arch: ModelArch
    default_name: str  # the served model id when --served-model-name is not given


def resolve_model(model: str) -> ModelSource:
    try:
        packaged = resolve_short_name(model)
    except PackagedModelMissing as exc:
        raise ModelSourceError(str(exc)) from None
    path = packaged or Path(model).expanduser()
    name = model if packaged else path.name
    if path.is_dir():
        return _hf_dir(path, name)
    if path.is_file():
        return _gguf_file(path, name)
    raise ModelSourceError(
        f"--model {model!r}: no such file or directory, and not a packaged model "
        f"(known short names: {', '.join(SHORT_NAMES)})")


def _hf_dir(path: Path, name: str) -> ModelSource:
    from pypto_serving.loader.hf import arch_from_hf_config, load_hf_config

    missing = [f for f in ("config.json",) if not (path / f).is_file()]
    if not list(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        missing.append("tokenizer.json or tokenizer.model")
    if missing:
        raise ModelSourceError(f"--model {str(path)!r} is not a usable checkpoint directory: "
                               f"missing {', '.join(missing)}")
    return ModelSource(path, "hf", arch_from_hf_config(load_hf_config(path)), name)


def _gguf_file(path: Path, name: str) -> ModelSource:
    from pypto_serving.loader.gguf_file import arch_from_gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelSourceError(f"--model {str(path)!r} is neither a checkpoint directory nor a "
                               "GGUF file (the file does not start with the GGUF magic)")
    return ModelSource(path, "gguf", arch_from_gguf(path), name.removesuffix(".gguf"))
