"""transformers as the oracle for the packaged GGUF files, loaded as cheaply as it allows.

transformers' GGUF model loading parses the file's whole metadata with gguf-py (every
vocabulary string, one Python object each) once to build the config and again for the weights:
for Gemma 3's 262k pieces ~25 s a parse on a 2-core machine. Inside `gguf_parsed_once` each
file is parsed once; what transformers builds from the parse is unchanged. Its tokenizers read
the file with a reader of their own; AutoTokenizer first parses the whole file with gguf-py
only to learn the model type, which `transformers_tokenizer` knows.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """gguf-py's reader, kept per file while the block runs (transformers' loader imports
    `gguf.GGUFReader` at each call, so it finds this one); freed after it (~0.7 GB for Gemma 3)."""
    original, readers = gguf.GGUFReader, {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def transformers_model(path: str) -> Any:
    """transformers' own load of a GGUF file (fp32, eval mode), each file parsed once."""
    import torch
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=path, dtype=torch.float32)
    return model.eval()


@functools.cache
def transformers_tokenizer(path: Path) -> Any:
    """What `AutoTokenizer.from_pretrained(dir, gguf_file=name)` returns, once per session.

    AutoTokenizer reads every tensor header and vocabulary string with gguf-py only to learn the
    model type (the file's `general.architecture`), then picks the class registered for it
    (TokenizersBackend when none is); we read the architecture with our own header reader
    (~0.1-0.5 s, against gguf-py's ~25 s for Gemma 3), make the same pick and call that class
    directly.
    """
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    from pypto_serving.loader.gguf_reader import read_gguf

    model_type = read_gguf(path).metadata["general.architecture"]
    cls = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")
    return cls.from_pretrained(str(path.parent), gguf_file=path.name)
