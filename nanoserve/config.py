"""The one engine configuration, built once from `LLM(...)` keyword arguments or CLI flags.

Owns: `EngineConfig` (frozen; every field validated on construction), `SpeculativeConfig` (the
speculative-decoding part of it, named as in SGLang and vLLM), the CLI flags that
set it (`add_engine_args` / `engine_config_from_args`), and the resolution of "auto"
choices (device, dtype, KV cache dtype). Limits that depend on the machine (KV pages from free memory)
are derived in one place, `nanoserve.engine.model_runner.plan_kv_capacity`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace

import torch

from nanoserve.models.registry import DEFAULT_MODEL
from nanoserve.switches import KernelSwitches

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
# KV cache storage: "auto" keeps the model's dtype; "fp8" stores float8 e4m3 values with no
# scale (saturating at +-448, rounded to nearest even), as vLLM's fp8_e4m3 without
# calibrated scales: half the bytes per token, so decode reads half and twice the tokens fit.
# The tokens of one prefill chunk attend to each other's K/V before that rounding (the
# Triton and FA2 kernels read them from the projection), to cached positions as stored.
_KV_DTYPES = {"fp8": torch.float8_e4m3fn}
_KV_DTYPE_ALIASES = {"fp8_e4m3": "fp8", "float8_e4m3fn": "fp8"}
SCHEDULE_POLICIES = ("prefill-first", "mixed")
# mixed by default: on two H200s (dummy llama-3.1-8b, 1024 in / 256 out) it kept 90% of
# requests within 500 ms to the first token and 25 ms per token up to 30 req/s against
# prefill-first's 28, with an inter-token p99 at 32 req/s of 33 ms against 225-287 ms
# (benchmarks/results/2026-11-27.md, 16:05-16:50).
DEFAULT_SCHEDULE_POLICY = "mixed"
# The mixed policy's budget (max_num_batched_tokens) while requests decode: every token of a
# step delays their next token, so its default depends on whether anyone reads tokens as
# they come, as vLLM's max_num_batched_tokens defaults differ between its LLM class and its
# server:
# - the server, `nanoserve chat` (and a bare EngineConfig): MIXED_STEP_TOKENS, small enough
#   that a step stays short (on an H200, dummy llama-3.1-8b at 16 and 32 req/s, ITL p99: 16.8
#   and 21.0 ms at 512, 23.9 and 30.0 ms at 768, 53.8 and 64.8 ms at 1024 (a run with kernels
#   still compiling mid-run, before 72cd501); goodput 24 req/s at 512 and 768,
#   benchmarks/results/2026-11-26.md);
# - the offline `LLM` and `nanoserve generate` (`EngineConfig.for_offline`): the prefill
#   budget, chunked_prefill_size. Their caller waits for every request to end, so only the
#   total time counts, and small steps only add steps (qwen3-0.6b offline on an H200: 1,380
#   steps at 512 against 1,043 under prefill-first).
# An explicit max_num_batched_tokens wins everywhere. The scheduler lets a step grow past it
# while prompts queue (up to MIXED_GROWTH times) and during a burst (to chunked_prefill_size): see
# BURST_START_SHARE in nanoserve/scheduler/scheduler.py.
MIXED_STEP_TOKENS = 512
TASKS = ("generate", "embed")


# ---- speculative decoding (nanoserve/engine/speculative): its settings, checked here ----------------

ALGORITHMS = ("ngram", "draft", "eagle3")
MAX_DRAFT_TOKENS = 16
# Draft tokens per step when not given. n-gram drafts cost only the verify step's extra
# positions (no draft forward), and copied text is accepted in long runs: propose more.
DEFAULT_DRAFT_TOKENS = {"ngram": 12, "draft": 4, "eagle3": 4}
# Above this many running requests a step does not speculate: a large batch is already
# bound by compute more than by the weights read, so verifying drafts costs more than it saves
# (vLLM's speculative_disable_by_batch_size).
DEFAULT_DISABLE_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str
    num_draft_tokens: int | None = None  # None: DEFAULT_DRAFT_TOKENS[algorithm]
    draft_model: str | None = None  # draft and eagle3: a path or a bundled alias
    ngram_min_match: int = 1  # shortest suffix of a request's tokens looked up
    ngram_max_match: int = 4  # longest; the longest that matches wins
    ngram_store_tokens: int = 1 << 20  # other requests' outputs kept for look-ups (0: off)
    disable_batch_size: int = DEFAULT_DISABLE_BATCH_SIZE
    cost_gate: bool = False  # see nanoserve.engine.speculative.step: pause while verifying costs more than it yields

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        k = self.num_draft_tokens
        if k is not None and (not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS):
            raise ValueError(f"speculative_num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {k!r}")
        needs_model = self.algorithm in ("draft", "eagle3")
        if needs_model and not self.draft_model:
            raise ValueError(f"speculative_algorithm={self.algorithm!r} needs speculative_draft_model")
        if not needs_model and self.draft_model:
            raise ValueError("speculative_draft_model is only used by the draft and eagle3 algorithms")
        if not 1 <= self.ngram_min_match <= self.ngram_max_match:
            raise ValueError(
                "speculative n-gram match lengths need 1 <= min <= max, got "
                f"min={self.ngram_min_match!r}, max={self.ngram_max_match!r}"
            )
        if self.ngram_store_tokens < 0:
            raise ValueError(f"speculative_ngram_store_tokens must be >= 0, got {self.ngram_store_tokens!r}")
        if self.disable_batch_size < 1:
            raise ValueError(f"speculative_disable_batch_size must be >= 1, got {self.disable_batch_size!r}")

    @property
    def k(self) -> int:
        """Draft tokens proposed per request and step (at most)."""
        return self.num_draft_tokens if self.num_draft_tokens is not None else DEFAULT_DRAFT_TOKENS[self.algorithm]


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None  # another model's tokenizer (a path or an alias)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    load_format: str = "auto"  # auto | dummy
    seed: int = 0
    max_model_len: int | None = None  # default: the model's context, capped by the KV cache
    page_size: int = 16
    chunked_prefill_size: int = 8192  # token budget of one prefill step
    max_num_seqs: int = 256
    # "prefill-first": a step is a prefill batch or a decode batch, prefill first (the slow
    # twin); "mixed": every running request decodes one token in each step, and prompt chunks
    # fill the step up to its token budget (nanoserve/scheduler/scheduler.py).
    schedule_policy: str = DEFAULT_SCHEDULE_POLICY
    # mixed: the token budget of a step in which requests decode (their tokens count); a step
    # with none decoding takes chunked_prefill_size prompt tokens. None: the entry point's
    # default (see MIXED_STEP_TOKENS): min(512, chunked_prefill_size) for the server,
    # chunked_prefill_size for the offline LLM (set by `for_offline`).
    max_num_batched_tokens: int | None = None
    memory_fraction: float = 0.9  # CUDA: share of free memory after weights for the KV cache
    kv_cache_tokens: int | None = None  # explicit KV capacity in tokens (default on CPU: 1 GiB)
    kv_cache_gib: float | None = None  # explicit KV capacity in GiB
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (float8 e4m3, unscaled)
    # None: weights as the checkpoint stores them (FP8 checkpoints stay FP8 on CUDA); "fp8":
    # linear weights quantized per output channel at load (nanoserve/models/quantization.py).
    quantization: str | None = None
    attention_backend: str = "auto"  # auto | torch | triton
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    cuda_graph_max_bs: int | None = None  # largest decode batch run by a CUDA graph; default from GPU memory
    piecewise_cuda_graphs: bool = True  # CUDA: prefill/extend batches replay graphs between attention calls
    # Triton backend: decode reads a prefix shared by several running requests once per step
    # (nanoserve.attention.cascade); needs the prefix cache, off under tensor parallelism.
    cascade_attention: bool = True
    overlap_schedule: bool = True  # CUDA: schedule step N+1 while the GPU runs step N
    tensor_parallel_size: int = 1
    # Multi-host tensor parallelism: the ranks are split evenly over `nnodes` hosts; every
    # host runs the same command with its own `node_rank`; node 0 runs the engine (rank 0).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of node 0's rendezvous (default: a free local port)
    dist_timeout_s: float = 300.0  # a collective waiting longer than this on a peer fails
    # Speculative decoding (nanoserve/engine/speculative): None (off), ngram, draft or eagle3; draft
    # tokens per step (default per algorithm); the draft model (draft, eagle3); the n-gram
    # look-up's suffix lengths; no speculation above this many running requests.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_draft_model: str | None = None
    speculative_ngram_min_match: int = 1
    speculative_ngram_max_match: int = 4
    speculative_disable_batch_size: int = DEFAULT_DISABLE_BATCH_SIZE
    speculative_cost_gate: bool = False  # pause speculation while a verify step costs more than it yields (opt-in)
    # The fast paths' switches (nanoserve/switches.py), read from NANOSERVE_* variables once
    # when the config is built; tests and benchmarks may pass their own.
    switches: KernelSwitches = field(default_factory=KernelSwitches.from_env)
    # "generate", or "embed": every request is one prefill whose last token's final hidden
    # state, L2-normalized, is its result (nanoserve/engine/pooling.py).
    task: str = "generate"

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(self.dtype, self.dtype))
        need(self.dtype == "auto" or self.dtype in _DTYPES, "dtype", f"must be auto or one of {sorted(_DTYPES)}")
        object.__setattr__(self, "kv_cache_dtype", _KV_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype))
        need(self.kv_cache_dtype in ("auto", *_KV_DTYPES), "kv_cache_dtype", "must be auto or fp8")
        need(self.quantization in (None, "fp8"), "quantization", "must be None or 'fp8'")
        need(self.load_format in ("auto", "dummy"), "load_format", "must be 'auto' or 'dummy'")
        need(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "device",
            "must be auto, cpu or cuda",
        )
        need(self.page_size >= 1, "page_size", "must be >= 1")
        need(self.chunked_prefill_size >= 1, "chunked_prefill_size", "must be >= 1")
        need(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        need(self.schedule_policy in SCHEDULE_POLICIES, "schedule_policy", f"must be one of {SCHEDULE_POLICIES}")
        need(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            "must be >= 1",
        )
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        need(0 < self.memory_fraction <= 1, "memory_fraction", "must be in (0, 1]")
        need(
            self.kv_cache_tokens is None or self.kv_cache_tokens >= 2 * self.page_size,
            "kv_cache_tokens",
            "must hold at least 2 pages",
        )
        need(self.kv_cache_gib is None or self.kv_cache_gib > 0, "kv_cache_gib", "must be > 0")
        need(
            self.attention_backend in ("auto", "torch", "triton"), "attention_backend", "must be auto, torch or triton"
        )
        need(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 0, "cuda_graph_max_bs", "must be >= 0")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        need(
            self.nnodes >= 1 and self.tensor_parallel_size % self.nnodes == 0,
            "nnodes",
            "must be >= 1 and divide tensor_parallel_size",
        )
        need(0 <= self.node_rank < self.nnodes, "node_rank", "must be in [0, nnodes)")
        need(
            self.nnodes == 1 or self.dist_init_addr is not None,
            "dist_init_addr",
            "is needed with nnodes > 1 (host:port of node 0)",
        )
        need(
            self.dist_init_addr is None or self.dist_init_addr.rpartition(":")[2].isdigit(),
            "dist_init_addr",
            "must be host:port",
        )
        need(self.dist_timeout_s > 0, "dist_timeout_s", "must be > 0")
        need(
            self.speculative_algorithm is not None
            or (self.speculative_num_draft_tokens is None and self.speculative_draft_model is None),
            "speculative_algorithm",
            "must be set when speculative_num_draft_tokens or speculative_draft_model is",
        )
        self.speculative_config()  # checks the speculative settings
        need(self.task in TASKS, "task", f"must be one of {TASKS}")
        need(
            self.task == "generate" or self.speculative_algorithm is None,
            "task",
            "embed cannot be combined with speculative decoding (an embedding request never decodes)",
        )
        if self.task == "embed":
            # Embedding requests never decode and keep no KV after their prefill: no prefix
            # cache, no decode graphs or cascade, and nothing to overlap (no sampled token).
            for name, value in (
                ("enable_prefix_caching", False),
                ("cuda_graph_max_bs", 0),
                ("cascade_attention", False),
                ("overlap_schedule", False),
            ):
                object.__setattr__(self, name, value)

    def for_linear_layers(self) -> EngineConfig:
        """This config for a model with linear-attention layers (Qwen3.5), whose per-request
        state (nanoserve.kvcache.linear_state) the prefix cache cannot restore: prompts are
        recomputed and the prefill graphs (which cut the forward at softmax attention only)
        stay off; speculative decoding, whose rejected drafts would have advanced the state, is
        refused."""
        if self.speculative_algorithm is not None:
            raise ValueError("speculative decoding is not supported for models with linear-attention layers (Qwen3.5)")
        return replace(self, enable_prefix_caching=False, piecewise_cuda_graphs=False)

    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculative-decoding settings, None when it is off."""
        if self.speculative_algorithm is None:
            return None
        return SpeculativeConfig(
            algorithm=self.speculative_algorithm,
            num_draft_tokens=self.speculative_num_draft_tokens,
            draft_model=self.speculative_draft_model,
            ngram_min_match=self.speculative_ngram_min_match,
            ngram_max_match=self.speculative_ngram_max_match,
            disable_batch_size=self.speculative_disable_batch_size,
            cost_gate=self.speculative_cost_gate,
        )

    @staticmethod
    def create(model: str = DEFAULT_MODEL, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine arguments {sorted(unknown)}; known: {sorted(known)}")
        return EngineConfig(model=model, **kwargs)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA GPU")
        return torch.device(self.device)

    def torch_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device().type == "cpu":
            return torch.float32  # CPU half-precision matmuls are slow and less exact
        return _DTYPES[checkpoint_dtype] if checkpoint_dtype in ("float16", "bfloat16") else torch.bfloat16

    def mixed_step_budget(self) -> int:
        """Tokens of a mixed step while requests decode (theirs included): max_num_batched_tokens,
        else the serving default, small so that their next token is not held up long by prompt
        chunks, and never above the prefill budget (see MIXED_STEP_TOKENS)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return min(MIXED_STEP_TOKENS, self.chunked_prefill_size)

    def for_offline(self) -> EngineConfig:
        """This config as the offline entry points run it (the `LLM` class, `nanoserve
        generate`): an unset max_num_batched_tokens becomes chunked_prefill_size, as nobody
        reads a token before its request ends (see MIXED_STEP_TOKENS); an explicit one stays."""
        if self.max_num_batched_tokens is not None:
            return self
        return replace(self, max_num_batched_tokens=self.chunked_prefill_size)

    def torch_kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """What the KV cache stores, for a model computing in `model_dtype`."""
        return model_dtype if self.kv_cache_dtype == "auto" else _KV_DTYPES[self.kv_cache_dtype]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="use another model's tokenizer")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--chunked-prefill-size", type=int, default=8192)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument(
        "--schedule-policy",
        default=DEFAULT_SCHEDULE_POLICY,
        choices=list(SCHEDULE_POLICIES),
        help="mixed: prompt chunks ride in decode steps; prefill-first: a step is all prefill or all decode",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"mixed: token budget of a step while requests decode (default: serve and chat min({MIXED_STEP_TOKENS}, "
        "--chunked-prefill-size), generate --chunked-prefill-size; with none decoding a step takes "
        "--chunked-prefill-size)",
    )
    g.add_argument("--memory-fraction", type=float, default=0.9)
    g.add_argument("--kv-cache-tokens", type=int, default=None)
    g.add_argument("--kv-cache-gib", type=float, default=None)
    g.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"], help="fp8: float8 e4m3 KV cache"
    )
    g.add_argument(
        "--quantization", default=None, choices=["fp8"], help="fp8: quantize linear weights per channel at load"
    )
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the radix prefix cache off")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--cuda-graph-max-bs", type=int, default=None, help="0: no decode CUDA graphs")
    g.add_argument("--no-piecewise-graphs", action="store_true", help="prefill/extend batches always run eagerly")
    g.add_argument("--no-cascade", action="store_true", help="decode reads shared prefixes once per request")
    g.add_argument("--no-overlap", action="store_true", help="simple loop: process each step's results before the next")
    g.add_argument(
        "--task",
        default="generate",
        choices=TASKS,
        help="embed: serve the decoder as an embedding model (/v1/embeddings: last-token pooling, normalized)",
    )
    g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    g.add_argument("--nnodes", type=int, default=1, help="hosts the tensor-parallel ranks span")
    g.add_argument("--node-rank", type=int, default=0, help="this host's index; node 0 runs the engine")
    g.add_argument("--dist-init-addr", default=None, help="host:port of node 0 for the rendezvous")
    g.add_argument("--dist-timeout", type=float, default=300.0, help="seconds a collective may wait for a peer")
    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--speculative-algorithm", default=None, choices=list(ALGORITHMS), help="off when not given")
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="draft tokens per step (1-16)")
    s.add_argument("--speculative-draft-model", default=None, help="draft / eagle3: the draft model's path")
    s.add_argument("--speculative-ngram-min-match", type=int, default=1, help="ngram: shortest suffix looked up")
    s.add_argument("--speculative-ngram-max-match", type=int, default=4, help="ngram: longest suffix looked up")
    s.add_argument(
        "--speculative-disable-batch-size",
        type=int,
        default=DEFAULT_DISABLE_BATCH_SIZE,
        help="no speculation in steps with more running requests than this",
    )
    s.add_argument(
        "--speculative-cost-gate",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pause speculation while verify steps cost more than they yield (off by default: measured slower)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        seed=args.seed,
        max_model_len=args.max_model_len,
        page_size=args.page_size,
        chunked_prefill_size=args.chunked_prefill_size,
        max_num_seqs=args.max_num_seqs,
        schedule_policy=getattr(args, "schedule_policy", DEFAULT_SCHEDULE_POLICY),
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
        memory_fraction=args.memory_fraction,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_gib=args.kv_cache_gib,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        quantization=getattr(args, "quantization", None),
        attention_backend=args.attention_backend,
        enable_prefix_caching=not args.no_prefix_cache,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        piecewise_cuda_graphs=not getattr(args, "no_piecewise_graphs", False),
        cascade_attention=not getattr(args, "no_cascade", False),
        overlap_schedule=not getattr(args, "no_overlap", False),
        tensor_parallel_size=args.tp,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        dist_timeout_s=args.dist_timeout,
        speculative_algorithm=getattr(args, "speculative_algorithm", None),
        speculative_num_draft_tokens=getattr(args, "speculative_num_draft_tokens", None),
        speculative_draft_model=getattr(args, "speculative_draft_model", None),
        speculative_ngram_min_match=getattr(args, "speculative_ngram_min_match", 1),
        speculative_ngram_max_match=getattr(args, "speculative_ngram_max_match", 4),
        speculative_disable_batch_size=getattr(args, "speculative_disable_batch_size", DEFAULT_DISABLE_BATCH_SIZE),
        speculative_cost_gate=getattr(args, "speculative_cost_gate", False),
        task=getattr(args, "task", "generate"),
    )
