"""benchmarks/guidellm_check.py hands guidellm the served model's tokenizer as a Hugging Face
directory: transformers loads it offline and encodes as the server does."""

from __future__ import annotations

from benchmarks.guidellm_check import tokenizer_dir
from pypto_serving.app.packaged_models import smollm2_path
from pypto_serving.tokenizer.tokenizer import Tokenizer


def test_the_tokenizer_directory_encodes_as_the_server(tmp_path, monkeypatch) -> None:
    import transformers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir(smollm2_path(), tmp_path / "tok"))
    ours = Tokenizer.from_gguf(smollm2_path())
    text = "The quick brown fox, 1 + 1 = 2."
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
