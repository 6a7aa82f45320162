"""What each process imports decides its resident memory: the API process reads a GGUF model's
shape and tokenizer without numpy, gguf-py or torch, loads llguidance and SentencePiece only
when a request or a model needs them, and building a model in the device
worker with packed weights (the CPU default) does not drag in sympy (torch's Python reference
ops import it; nn.Linear's random init on the meta device still does, on the exact path)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = ("numpy", "gguf", "torch", "sympy")
ON_DEMAND = ("llguidance", "sentencepiece")


def imported_after(code: str, watched: tuple[str, ...] = HEAVY) -> list[str]:
    probe = textwrap.dedent(code) + f"\nimport sys\nprint([m for m in {watched!r} if m in sys.modules])\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own probe's list


def test_the_api_process_reads_a_gguf_model_without_heavy_imports(smollm2_gguf: str) -> None:
    assert imported_after("""
        from pypto_serving.app.model_source import resolve_model
        from pypto_serving.tokenizer.tokenizer import Tokenizer
        source = resolve_model("smollm2")
        Tokenizer.from_gguf(source.path).encode("hello")
        assert source.arch.rms_norm_eps == 1e-05, source.arch.rms_norm_eps  # float32 read back
    """) == []


def test_the_api_process_starts_without_grammar_or_sentencepiece_libraries(smollm2_gguf: str) -> None:
    code = """
        import pypto_serving.app.cli, pypto_serving.app.launch
        import pypto_serving.actors.engine, pypto_serving.http
        from pypto_serving.app.model_source import resolve_model
        from pypto_serving.tokenizer.tokenizer import Tokenizer
        Tokenizer.from_gguf(resolve_model("smollm2").path).encode("hello")
    """
    assert imported_after(code, HEAVY + ON_DEMAND) == []
    # the first structured-output request loads llguidance
    assert imported_after(code + """
        from pypto_serving.parsers.grammar import response_format_grammar
        response_format_grammar({"type": "json_object"})
    """, ON_DEMAND) == ["llguidance"]


def test_building_a_model_does_not_import_sympy() -> None:
    assert "sympy" not in imported_after("""
        import torch
        from pypto_serving.loader.hf import arch_from_hf_config
        from pypto_serving.models import LayerFactory, build_model
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                  "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
        build_model(arch_from_hf_config(config), torch.float32, "cpu", layers=LayerFactory("int4"))
    """)
