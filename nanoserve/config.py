"""The one engine configuration, built once from `LLM(...)` keyword arguments or CLI flags.

Owns: `EngineConfig` (frozen; every field validated on construction), the CLI flags that
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
# (benchmarks/RESULTS.md 2026-11-27, 16:05-16:50).
DEFAULT_SCHEDULE_POLICY = "mixed"
# The mixed policy's budget (max_num_batched_tokens) while requests decode: every token of a
# step delays their next token, so its default depends on whether anyone reads tokens as
# they come, as vLLM's max_num_batched_tokens defaults differ between its LLM class and its
# server:
# - the server, `nanoserve chat` (and a bare EngineConfig): MIXED_STEP_TOKENS, small enough
#   that a step stays short (on an H200, dummy llama-3.1-8b at 16 and 32 req/s, ITL p99: 16.8
#   and 21.0 ms at 512, 23.9 and 30.0 ms at 768, 53.8 and 64.8 ms at 1024 (a run with kernels
#   still compiling mid-run, before 72cd501); goodput 24 req/s at 512 and 768,
#   benchmarks/RESULTS.md 2026-11-26);
# - the offline `LLM` and `nanoserve generate` (`EngineConfig.for_offline`): the prefill
#   budget, chunked_prefill_size. Their caller waits for every request to end, so only the
#   total time counts, and small steps only add steps (qwen3-0.6b offline on an H200: 1,380
#   steps at 512 against 1,043 under prefill-first).
# An explicit max_num_batched_tokens wins everywhere. The scheduler lets a step grow past it
# while prompts queue (up to MIXED_GROWTH times) and during a burst (to chunked_prefill_size): see
# BURST_START_SHARE in nanoserve/scheduler/scheduler.py.
MIXED_STEP_TOKENS = 512


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
    # The fast paths' switches (nanoserve/switches.py), read from NANOSERVE_* variables once
    # when the config is built; tests and benchmarks may pass their own.
    switches: KernelSwitches = field(default_factory=KernelSwitches.from_env)

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
    g.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    g.add_argument("--nnodes", type=int, default=1, help="hosts the tensor-parallel ranks span")
    g.add_argument("--node-rank", type=int, default=0, help="this host's index; node 0 runs the engine")
    g.add_argument("--dist-init-addr", default=None, help="host:port of node 0 for the rendezvous")
    g.add_argument("--dist-timeout", type=float, default=300.0, help="seconds a collective may wait for a peer")


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
    )
