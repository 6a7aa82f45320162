"""The packed-weight disk cache (`--weight-cache-dir`): after a load that dequantizes or packs
(a GGUF file, or any packed `--quantization`), the model's state (models/packed_state.py) is
written to one file; the next start with the same key maps that file (torch.load(mmap=True))
instead of reading, dequantizing and packing the checkpoint again.

Key: the packing version (bump PACKING_VERSION whenever what loading produces changes; a
digest of the loading and packing modules' source backs it up), torch's and gguf-py's
versions, the model's resolved path, format and shape, each model file's identity, the
backend, device, dtype and quantization flags. A file's identity is its size, its mtime
(ns) and a SHA-256 of its first 16 MiB and last 4 MiB (the GGUF header, metadata and tensor
infos, or a safetensors header, and the last tensors' bytes): a replaced, re-downloaded or
rewritten checkpoint misses, at ~10 ms a start. A full hash would also catch a same-size
edit in the middle that kept the mtime, at ~0.3 s per 500 MB on every start (more when the
file is not in the page cache); mtime and size already change with every ordinary write.

Files: `NAME-SLOT-DIGEST.pt`, NAME from the model, SLOT a digest of what selects the entry
(model path and flags), DIGEST of the whole key. Written to a temporary file, fsynced, then
renamed: a crash leaves no half entry. Saving one removes the entries it supersedes (same
slot), entries whose model file is gone, and temporary files older than an hour. An entry
that cannot be read or does not fit the model is logged, removed and rebuilt, never fatal;
so is a cache that cannot be written. Tensors are 64-byte aligned in torch's format (the C
kernels' 32-byte loads never straddle a cache line needlessly; safetensors aligns to 8).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog
import torch
from torch import nn

import pypto_serving
from pypto_serving.messages.worker import ModelConfig, ModelFormat, Quantization, WorkerConfig
from pypto_serving.models.packed_state import packed_state, restore_state

log = structlog.get_logger()

PACKING_VERSION = 2  # 2: --quantization auto packs Q5_0 grids to int5
# The modules whose code decides the tensors an entry holds.
SOURCES = ("loader/gguf_file.py", "loader/gguf_reader.py", "loader/hf.py", "models/weights.py",
           "models/quant.py", "models/packed_state.py", "kernels/quant_linear.py", "worker/weight_cache.py")
# What selects an entry; a newer entry of the same slot supersedes the old one.
SLOT_FIELDS = ("model", "format", "backend", "device", "dtype", "quantization", "activations", "shard")
HEAD_BYTES, TAIL_BYTES = 16 << 20, 4 << 20
STALE_TEMP_S = 3600.0


def load_with_cache(model: nn.Module, cfg: WorkerConfig, load: Callable[[], None],
                    shard: tuple[int, int] = (0, 1), device: str = "") -> str:
    """Fills `model` from the cache entry of `cfg`, else with `load()` and then writes the
    entry. Returns how: "cache", "checkpoint" (entry written or not) or "uncached"."""
    if not cfg.weight_cache_dir or not worth_caching(cfg):
        load()
        return "uncached"
    key = cache_key(cfg, shard)
    path = entry_path(Path(cfg.weight_cache_dir), cfg.model, key)
    if _restore(model, path, key, torch.device(device or cfg.device.device)):  # this rank's device
        return "cache"
    load()
    _save(model, path, key)
    return "checkpoint"


def worth_caching(cfg: WorkerConfig) -> bool:
    """Loading transforms the weights: GGUF dequantizes, packing packs. (An unpacked HF
    checkpoint loads from its memory-mapped safetensors already: a copy would only cost disk.)"""
    return cfg.model.format == ModelFormat.GGUF or cfg.quant.weights != Quantization.NONE


def cache_key(cfg: WorkerConfig, shard: tuple[int, int] = (0, 1)) -> dict:
    """`shard`: (tensor-parallel rank, ranks): each rank caches its own part."""
    model, device, quant = cfg.model, cfg.device, cfg.quant
    key = {
        "packing_version": PACKING_VERSION,
        "code": _code_digest(),
        "torch": torch.__version__,
        "gguf": importlib.metadata.version("gguf") if model.format == ModelFormat.GGUF else None,
        "model": str(Path(model.path).resolve()),
        "format": model.format,
        "files": [file_identity(p) for p in model_files(model)],
        "arch": msgspec.to_builtins(model.arch),
        "backend": device.backend,
        "device": device.device,
        "dtype": device.dtype,
        "quantization": quant.weights,
        "activations": quant.activations,
        "shard": list(shard),
    }
    return json.loads(json.dumps(key))  # the types a stored key reads back as


def entry_path(directory: Path, model: ModelConfig, key: dict) -> Path:
    slot = {k: key[k] for k in SLOT_FIELDS}
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model.path).name.removesuffix(".gguf"))[:80]
    return directory / f"{name}-{_digest(slot)[:12]}-{_digest(key)[:16]}.pt"


def model_files(model: ModelConfig) -> list[Path]:
    path = Path(model.path)
    if model.format == ModelFormat.GGUF:
        return [path]
    return [path / "config.json", *sorted(path.glob("*.safetensors"))]


def file_identity(path: Path) -> list:
    """[name, size, mtime ns, SHA-256 of the first HEAD_BYTES and last TAIL_BYTES]."""
    st = path.stat()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(HEAD_BYTES))
        if st.st_size > HEAD_BYTES:
            f.seek(max(HEAD_BYTES, st.st_size - TAIL_BYTES))
            digest.update(f.read(TAIL_BYTES))
    return [path.name, st.st_size, st.st_mtime_ns, digest.hexdigest()]


def _code_digest() -> str:
    root = Path(pypto_serving.__file__).parent
    return hashlib.sha256(b"".join((root / s).read_bytes() for s in SOURCES)).hexdigest()[:16]


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _restore(model: nn.Module, path: Path, key: dict, device: torch.device) -> bool:
    if not path.is_file():
        log.info("weight cache miss: packing from the checkpoint", entry=str(path))
        return False
    start = time.monotonic()
    try:  # (another process may remove the entry meanwhile: then it is rebuilt too)
        size = path.stat().st_size
        entry = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if entry.get("key") != key:
            raise ValueError("its key is not this model's")
        restore_state(model, entry["tensors"], entry["bits"], device)
    except Exception as exc:  # corrupt, truncated, foreign or not fitting: rebuilt, never fatal
        log.warning("weight cache entry unreadable: packing from the checkpoint", entry=str(path),
                    error=f"{type(exc).__name__}: {exc}")
        _remove(path)
        return False
    log.info("weight cache hit", entry=str(path), mib=size >> 20,
             seconds=round(time.monotonic() - start, 2))
    return True


def _save(model: nn.Module, path: Path, key: dict) -> None:
    start = time.monotonic()
    tensors, bits = packed_state(model)
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save({"key": key, "bits": bits, "tensors": tensors}, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(temp, path)
    except (OSError, RuntimeError) as exc:  # unwritable, full disk: served uncached
        log.warning("weight cache entry not written", entry=str(path), error=str(exc))
        if temp is not None:
            _remove(Path(temp))
        return
    _sweep(path, key)
    log.info("weight cache entry written", entry=str(path), mib=path.stat().st_size >> 20,
             seconds=round(time.monotonic() - start, 2))


def _sweep(kept: Path, key: dict) -> None:
    """Removes the entries `kept` supersedes, those of models that are gone, and old
    temporary files."""
    slot = kept.name.rsplit("-", 1)[0] + "-"
    for other in kept.parent.glob("*.pt"):
        if other != kept and (other.name.startswith(slot) or not _model_exists(other)):
            _remove(other)
    for temp in kept.parent.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - temp.stat().st_mtime > STALE_TEMP_S:
                _remove(temp)


def _model_exists(entry: Path) -> bool:
    try:
        model = torch.load(entry, map_location="cpu", mmap=True, weights_only=True)["key"]["model"]
    except Exception:  # not an entry we can read: nothing to keep it for
        return False
    return Path(model).exists()


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
