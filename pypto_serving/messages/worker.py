"""The device worker's pipe messages (msgpack-encoded msgspec Structs), both directions.

To the worker: `WorkerConfig` once at start, then `StepPlan` per step, `StartProfile` /
`StopProfile` around a profile, `Shutdown` at the end. From the worker: `WorkerReady` (or
`WorkerFailed`) as the handshake, then one `StepResult` per `StepPlan` and one
`ProfileStopped` per `StopProfile`, in order. A leaf: imports nothing of ours above it.
"""

from __future__ import annotations

import enum

import msgspec

from pypto_serving.core.sampling_params import SamplingParams
from pypto_serving.loader.arch import ModelArch


class ModelFormat(enum.StrEnum):
    HF = "hf"  # a Hugging Face checkpoint directory
    GGUF = "gguf"


class BackendName(enum.StrEnum):
    PORTABLE = "portable"
    CPU = "cpu"
    CUDA = "cuda"
    NPU = "npu"


class DType(enum.StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    AUTO = "auto"  # the KV cache only: the model's dtype


class Quantization(enum.StrEnum):
    """Weight-only packing (models/quant.py)."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"
    AUTO = "auto"  # int4 where the weights sit on a 4-bit grid (lossless), else int8


class ActivationQuantization(enum.StrEnum):
    NONE = "none"
    INT8 = "int8"  # the CPU's packed matmuls quantize their inputs per row and group of 32
    INT16 = "int16"  # ... to two int8 planes (value and rounding residual): near exact
    MIXED = "mixed"  # ... to int8, with the residual plane for each row's outlier groups


class LogFormat(enum.StrEnum):
    CONSOLE = "console"
    JSON = "json"


class ModelConfig(msgspec.Struct, frozen=True):
    path: str  # HF checkpoint directory or .gguf file
    format: ModelFormat
    arch: ModelArch


class DeviceConfig(msgspec.Struct, frozen=True):
    backend: BackendName
    device: str  # torch device string, e.g. "cpu", "cuda:0"
    dtype: DType
    kv_cache_dtype: DType = DType.AUTO
    threads: int = 0  # compute threads of each worker process on the host (0: torch's default)
    enforce_eager: bool = False  # `--enforce-eager`: no decode graphs, every step eager


class QuantConfig(msgspec.Struct, frozen=True):
    weights: Quantization = Quantization.NONE
    activations: ActivationQuantization = ActivationQuantization.NONE


class KVCacheConfig(msgspec.Struct, frozen=True):
    block_size: int
    max_num_blocks: int  # upper bound on KV blocks (enough for every running sequence)
    host_bytes: int  # the budget where the KV cache lives in host memory (portable, cpu)
    gpu_memory_utilization: float = 0.9  # fraction of device memory for weights + KV on accelerators


class StepLimits(msgspec.Struct, frozen=True):
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int


class LogConfig(msgspec.Struct, frozen=True):
    format: LogFormat = LogFormat.CONSOLE
    level: str = "info"


class GrammarConfig(msgspec.Struct, frozen=True):
    tokenizer_json: str = ""  # HF tokenizers JSON for grammar masks; "" = no constrained decoding
    eos_token_id: int | None = None  # the EOS llguidance allows once a grammar is complete


class ParallelConfig(msgspec.Struct, frozen=True):
    """One replica's tensor-parallel group of `tp` ranks over `nnodes` hosts, split evenly
    and in order (node 0 holds rank 0). `devices`: this node's device ids, one per rank on it."""

    tp: int = 1
    devices: list[int] = msgspec.field(default_factory=lambda: [0])
    master_addr: str = "127.0.0.1"  # where rank 0's torch.distributed store listens
    master_port: int = 0  # 0: a free port, picked when the group starts (one node only)
    nnodes: int = 1
    node_rank: int = 0
    timeout_s: float = 120.0  # how long the ranks wait for each other at startup

    @property
    def ranks_per_node(self) -> int:
        return self.tp // self.nnodes

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def local_ranks(self) -> range:
        """The ranks on this node."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def device_of(self, rank: int) -> int:
        """The device id of one of this node's ranks."""
        return self.devices[rank - self.local_ranks.start]


ON_THE_HOST = ("portable", "cpu")  # backends that run in the worker process's own memory


def device_string(backend: str, device_id: int) -> str:
    """The torch device of one device id ("cpu" for the backends on the host)."""
    return "cpu" if backend in ON_THE_HOST else f"{backend}:{device_id}"


class WorkerConfig(msgspec.Struct, frozen=True):
    """Everything the device worker is started with, one small config per concern."""

    model: ModelConfig
    device: DeviceConfig
    kv_cache: KVCacheConfig
    limits: StepLimits
    quant: QuantConfig = msgspec.field(default_factory=QuantConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    grammar: GrammarConfig = msgspec.field(default_factory=GrammarConfig)
    seed: int | None = None  # `--seed`: where unseeded requests' seeds come from (None: at random)
    weight_cache_dir: str = ""  # `--weight-cache-dir`: packed weights kept across starts ("": none)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)


# In `ScheduledSeq.token_ids`: the token the worker sampled for the sequence in the step
# before (async scheduling plans a step while the one before it runs).
PLACEHOLDER = -1


class ScheduledSeq(msgspec.Struct, frozen=True, array_like=True):
    """One sequence's share of a step.

    `token_ids` are the tokens whose KV is computed this step, at positions
    `start_pos .. start_pos + len(token_ids) - 1`. With `reset` the worker (re)starts the
    sequence: `prefix_ids` are the tokens already in the KV cache (prefix-cache hits, so
    len(prefix_ids) == start_pos), `new_block_ids` is the whole block table, `sampling` is
    set, and `num_prompt_tokens` tells where generated tokens begin (after a preemption,
    tokens past the prompt are earlier outputs being recomputed). Without `reset`,
    `new_block_ids` are appended to the block table the worker already has. `sample` is
    true when the chunk ends at the last known token, so one new token is sampled after it.
    With `num_draft` k > 0 the chunk's last k tokens are speculative proposals, not known
    tokens: a token is sampled after each of the last k + 1, and the proposals are kept up to
    the first one that differs from what was sampled in its place (core/speculative.py).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    new_block_ids: list[int]
    sample: bool
    reset: bool = False
    prefix_ids: list[int] = []
    num_prompt_tokens: int = 0
    sampling: SamplingParams | None = None
    num_draft: int = 0


class StepPlan(msgspec.Struct, frozen=True, tag=True):
    step_id: int
    seqs: list[ScheduledSeq]
    finished: list[int] = []  # sequence ids whose state the worker can drop


class Idle(msgspec.Struct, frozen=True, tag=True):
    """Rank 0 to the other ranks of its group: no step came for a while (they trim memory)."""


class RankStart(msgspec.Struct, frozen=True):
    """What a tensor-parallel rank other than 0 is started with (its one argument, JSON); the
    rest of its config comes from rank 0 once the group has formed."""

    rank: int
    parallel: ParallelConfig  # this node's view: its own device ids
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    model_path: str = ""  # where this node has the model ("": where rank 0 has it)
    parent_pid: int = 0  # the process that started it: it ends with that one


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class StartProfile(msgspec.Struct, frozen=True, tag=True):
    levels: list[str]  # e2e, kernel, verbose
    prefix: str  # fragment path prefix; the worker appends its own name


class StopProfile(msgspec.Struct, frozen=True, tag=True):
    pass


class ProfileStopped(msgspec.Struct, frozen=True, tag=True):
    paths: list[str]  # the fragments this worker wrote


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Logprobs of a run of one sequence's prompt tokens, each given the tokens before it:
    entry i is the token at position `first + i` (first >= 1: the first token has none), its
    rank among all tokens (1: the most likely) and the top-k list (empty when k is 0)."""

    seq_id: int
    first: int
    logprobs: list[float]
    ranks: list[int]
    top: list[list[TopLogprob]]


class StepResult(msgspec.Struct, frozen=True, tag=True):
    """Tokens sampled in one step: `token_ids[i]` belongs to `seq_ids[i]`.

    `seq_ids` lists exactly the scheduled sequences with `sample` true, in plan order; a
    sequence with proposals (`num_draft`) appears once per token it got: the proposals it
    kept, then the token sampled after them.
    `logprobs[i]` is the chosen token's logprob, when its sequence asked for logprobs
    (else 0.0); `top_logprobs[i]` its top-k list (empty when not asked). `prompt_logprobs`
    covers the prompt tokens this step scored, for the sequences that asked for them.
    """

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] = []
    top_logprobs: list[list[TopLogprob]] = []
    prompt_logprobs: list[PromptLogprobs] = []
    error: str | None = None


class WorkerReady(msgspec.Struct, frozen=True, tag=True):
    num_blocks: int
    weight_bytes: int
    kv_cache_bytes: int
    # what the matmuls really run: "c" (kernels/cpu, built on this machine) or "portable",
    # and "int8" only where the C kernels quantize the activations
    kernels: str = "portable"
    activation_quantization: str = "none"
    kv_budget: str = ""  # how the KV cache's bytes were found (backends/budget.py)
    graph_sizes: list[int] = []  # decode batch sizes replayed from captured graphs (none: eager)


class WorkerFailed(msgspec.Struct, frozen=True, tag=True):
    message: str


