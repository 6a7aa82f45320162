"""guidellm, the standard serving benchmark, unmodified against pypto-serving: both of its
OpenAI backends (text and chat completions) must answer every request.

guidellm is too heavy for the test suite (datasets, sanic, uvloop, transformers), so it runs
here, from a virtualenv of its own:

    python3 -m venv /tmp/glvenv && /tmp/glvenv/bin/pip install -c constraints.txt guidellm==0.8.1
    python benchmarks/guidellm_check.py --guidellm /tmp/glvenv/bin/guidellm

No model hub is reachable, so guidellm's tokenizer (for its synthetic prompts) is the served
model's own, written as a Hugging Face tokenizer directory. Prints one line per backend and
exits 1 if any request failed or the server's token counts were not read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.servers import Server, ours_command  # noqa: E402
from pypto_serving.app.packaged_models import smollm2_path  # noqa: E402
from pypto_serving.tokenizer.tokenizer import Tokenizer  # noqa: E402

FORMATS = ("/v1/completions", "/v1/chat/completions")


def tokenizer_dir(model: Path, out: Path) -> Path:
    """The model's tokenizer as a Hugging Face tokenizer directory guidellm can load offline."""
    tok = Tokenizer.from_gguf(model)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.tokenizers_json())
    special = tok.convert_ids_to_tokens([tok.bos_token_id, tok.eos_token_id])
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": special[0], "eos_token": special[1]}))
    return out


def run_guidellm(guidellm: str, url: str, request_format: str, tokenizer: Path, out: Path,
                 args: argparse.Namespace) -> dict:
    """One bounded guidellm run; its first benchmark's request totals and token counts."""
    result = out / f"{request_format.strip('/').replace('/', '_')}.json"
    command = [
        guidellm, "run",
        "--backend", f"kind=openai_http,target={url},model=smollm2,request_format={request_format}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--data", (f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                   f"output_tokens={args.output_tokens}"),
        "--profile", f"kind=concurrent,streams={args.concurrency}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--constraint", "kind=max_duration,seconds=300",
        "--output", f"kind=json,path={result}", "--disable-progress",
    ]
    subprocess.run(command, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=out,
                   stdout=subprocess.DEVNULL)
    metrics = json.loads(result.read_text())["benchmarks"][0]["metrics"]
    return {"totals": metrics["request_totals"],
            "output_tokens": metrics["output_token_count"]["successful"]["total_sum"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    args = p.parse_args()
    model = smollm2_path()
    server = Server("ours", ours_command(str(model), [])).start()
    failed = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = tokenizer_dir(model, Path(tmp) / "tokenizer")
            for request_format in FORMATS:
                got = run_guidellm(args.guidellm, server.url, request_format, tokenizer, Path(tmp), args)
                totals, expected = got["totals"], args.requests * args.output_tokens
                ok = totals["successful"] == args.requests and got["output_tokens"] == expected
                failed |= not ok
                print(f"{request_format:<24} successful {totals['successful']}/{totals['total']}, "
                      f"errored {totals['errored']}, output tokens {got['output_tokens']:.0f}/{expected}"
                      f" {'ok' if ok else 'FAILED'}")
    finally:
        server.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
