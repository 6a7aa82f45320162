"""benchmarks/compare.py without servers: workloads, ratio summary, JSON, server commands."""

from __future__ import annotations

import json

import pytest

from benchmarks.compare import MODELS, Runs, build_parser, start_servers, summary, to_json, workloads
from benchmarks.serve_bench import BenchConfig, RequestResult, summarize
from benchmarks.servers import PORT, Server, llama_server_command, ours_command
from pypto_serving.app.packaged_models import SHORT_NAMES


def result(tokens_per_s: float, ttft_s: float) -> object:
    done = RequestResult(prompt_len=128, ok=True, ttft=ttft_s, e2e=ttft_s + 1,
                         output_tokens=int(tokens_per_s))
    return summarize(BenchConfig(), [done], duration_s=1.0)


def test_workloads_cover_the_issue_loads() -> None:
    loads = {w.name: w for w in workloads(1.0)}
    assert loads["c1 128/128"].bench.concurrency == 1
    assert loads["c16 512/128"].bench.input_len == 512
    shared = loads["c16 shared 400+64/128"]
    assert shared.bench.dataset == "shared-prefix" and shared.bench.prefix_len == 400
    assert "ours-no-prefix-cache" in shared.servers
    for name in ("c1 128/128 sampled", "c16 128/128 sampled"):  # llama.cpp's default cuts, spelled out
        sampled = loads.pop(name).bench
        assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.min_p) == (0.8, 40, 0.95, 0.05)
        assert sampled.seed != loads["c16 128/128"].bench.seed  # not the greedy loads' prompts, cached
    assert all(w.bench.ignore_eos and w.bench.temperature == 0.0 for w in loads.values())


def c16_summary(other: str, pairs: list[tuple[float, float]], other_ttft_s: float) -> tuple[Runs, str]:
    """c16 128/128 runs of ours (TTFT 1 s) and `other`, tok/s in pairs; the summary's text."""
    runs = Runs()
    for ours, theirs in pairs:
        runs.add("c16 128/128", "ours", result(ours, 1.0))
        runs.add("c16 128/128", other, result(theirs, other_ttft_s))
    loads = [w for w in workloads(1.0) if w.name == "c16 128/128"]
    return runs, "\n".join(summary(runs, loads))


def test_summary_reports_ratios_per_repetition() -> None:
    runs, text = c16_summary("llama", [(300, 100), (360, 120), (250, 100)], 4.0)
    assert "c16 128/128: ours / llama" in text
    assert "3.00 [2.50, 3.00]" in text  # throughput ratio: median [min, max]
    assert "0.25 [0.25, 0.25]" in text  # TTFT ratio
    assert json.loads(json.dumps(to_json(runs)))[0]["server"] == "ours"


def test_server_commands_share_model_and_capacity() -> None:
    ours = ours_command("/m.gguf", ["--foo"])
    llama = llama_server_command("/m.gguf", "/bin/llama-server", 2)
    assert ours[-1] == "--foo" and "/m.gguf" in ours and "/m.gguf" in llama
    assert llama[llama.index("-c") + 1] == "16384" and llama[llama.index("--parallel") + 1] == "16"
    server = Server("x", ours)
    assert PORT not in server.command and str(server.port) in server.command
    assert build_parser().parse_args(["--reps", "2"]).reps == 2
    assert Server("y", ours, port=18123).command[ours.index(PORT)] == "18123"


def test_every_packaged_model_is_a_choice() -> None:
    """Gemma 3 270M (a base model: the workloads send token ids to /v1/completions, no chat
    template) as well as the two instruct models; each name is one the server resolves."""
    assert set(MODELS) == set(SHORT_NAMES)
    assert "gemma3-270m" in build_parser().format_help()
    assert all(w.bench.endpoint == "/v1/completions" for w in workloads(1.0))


def test_ours_base_is_another_tree_measured_side_by_side(tmp_path) -> None:
    """`ours-base` runs pypto-serving from --base-tree (a worktree of another commit), and the
    summary adds ours / ours-base per repetition; without a tree holding the package it refuses
    before starting anything."""
    _, text = c16_summary("ours-base", [(330, 300), (280, 250), (400, 320)], 1.0)
    assert "c16 128/128: ours / ours-base" in text and "1.12 [1.10, 1.25]" in text
    args = build_parser().parse_args(["--servers", "ours,ours-base", "--base-tree", str(tmp_path)])
    with pytest.raises(SystemExit, match="--base-tree"):
        start_servers(args, "/m.gguf")
    assert Server("b", ours_command("/m.gguf", []), cwd=str(tmp_path)).cwd == str(tmp_path)
