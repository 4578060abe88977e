"""Every `NANOSERVE_*` environment variable: declared here, read here and nowhere else.

Owns `KernelSwitches`, the fast paths' on/off switches (each turns a fast path off in favour
of its slow twin, for debugging and A/B measurements), read once from the environment by
`KernelSwitches.from_env()` when an `EngineConfig` is built, validated, and handed to
every user (model layers, attention backend, sampler, tensor-parallel set-up) through the
config: no module reads a switch from a global. Also owns the two settings that are not
switches: the server's default API key and the tokenizer cache folder.

Invariants:
- a `NANOSERVE_*` variable that is not declared here gets a warning (a typo would otherwise
  silently leave a fast path on);
- an invalid value raises ValueError naming the variable;
- switches that differ from their defaults are logged once per process (`log_nondefault`);
- tensor-parallel ranks receive the switches inside the pickled config, so every rank runs
  with rank 0's switches whatever its own environment says.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "NANOSERVE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class KernelSwitches:
    """The fast paths' switches; the field `x` is read from `NANOSERVE_X` (upper case)."""

    # Triton decode kernels (small-M matmul, norms, rotary, SiLU); off: torch / cuBLAS.
    triton_ops: bool = True
    # Programmatic dependent launch of the Triton kernels (Hopper and later).
    pdl: bool = True
    # torch.compile'd elementwise ops on CUDA (SiLU-and-mul, norms where Triton is off); off: plain torch.
    fused: bool = True
    # The Triton SiLU-and-mul (where layers.silu_and_mul's size rule gives it); off: the torch.compile'd one.
    triton_silu: bool = True
    # The MLP's gate_up GEMV applies SiLU-and-mul in its epilogue (one launch); off: two kernels.
    gemv_silu: bool = True
    # Split-K partials of o_proj/down summed by the next RMSNorm; off: a sum kernel of their own.
    split_sum_in_norm: bool = True
    # The rotary kernel also writes the new K/V into the cache; off: attention's own store kernel.
    kv_store_in_rope: bool = True
    # At one row the qkv GEMV rotates q and k (and stores K/V) in its epilogue; off: the rotary kernel.
    rope_in_gemv: bool = True
    # Speculative verify steps: at 2..16 rows the split-K qkv product's partials are summed, rotated and stored
    # (with K/V) by one epilogue kernel, at 5..16 rows gate_up runs the gated dot kernel (SiLU-and-mul in its
    # epilogue); off: the sum, rotary and SiLU-and-mul kernels apart (kernels/qkv_rope.py, linear.py).
    # llama-3.1-8b's K=4 verify step at batch 1: 1.103x a decode step with it, 1.125x without (H200,
    # benchmarks/results/2026-12-02.md; 1.350x while the gated dot kernel still launched under PDL).
    fused_16_rows: bool = True
    # Decode attention launches the kv heads of a request next to each other; off: one head of every request first.
    decode_heads_first: bool = True
    # Triton sampler for greedy / plain-temperature batches; off: the torch path.
    fused_sampler: bool = True
    # Gated DeltaNet prefill (Qwen3.5) through fla-core's varlen chunked kernels on CUDA in 16-bit, where
    # fla imports; off: the torch chunked rule, requests padded side by side (nanoserve/kernels/gated_delta_fla.py).
    fla: bool = True
    # Sliding-window layers give back the pages that fell out of their window (window groups,
    # nanoserve/kvcache/window.py); off: every layer keeps every position, as full attention.
    window_pages: bool = True
    # gpt-oss's experts through the fused MoE kernels on CUDA (only the chosen experts read); off: the
    # graph-safe torch sum over every expert (13x slower at batch 1 on gpt-oss-20b, H200 2026-12-01).
    fused_gpt_oss: bool = True
    # gpt-oss's MXFP4 experts stay packed (4-bit codes, a scale byte per 32) and the fused MoE kernels decode
    # them in registers, the torch twins per expert; off: dequantized to the compute dtype at load (3.8x the
    # expert bytes in bf16). Off by default: correct on a GPU and a quarter of the memory (gpt-oss-120b fits
    # one H200 only so), and gpt-oss-20b decodes a batch of one at 1.78 ms per token with it against 2.78
    # without (measured before its router took one launch), but its large batches take the grouped MXFP4
    # kernels: 7,947 output tok/s offline against 9,234 with bf16 experts (two H200 hosts, 2026-12-03).
    mxfp4_experts: bool = False
    # FP8 MoE experts stay e4m3 in the fused MoE kernels on CUDA; off: dequantized to the compute dtype at
    # load (the linears keep FP8). Off by default: correct on a GPU, but slower at one token and at
    # prefill sizes than the bf16 experts (docs/fp8.md).
    fp8_experts: bool = False
    # Tensor parallelism: all-reduce row-parallel partial sums in fp32 and round once (off: model dtype).
    tp_reduce_fp32: bool = False
    # Tensor parallelism: fused all-reduce + RMSNorm over symmetric memory in decode graphs; off: NCCL.
    symm_mem: bool = True
    # How the fused all-reduce exchanges partials: auto, ll (low-latency words) or pull (flags + reads).
    symm_protocol: str = "auto"
    # At batch 1 the GEMV sends its partials to the peers itself; off: the sum's kernel sends them.
    symm_push: bool = True
    # Largest partial-sum tensor (bytes) that takes the symmetric-memory path.
    symm_mem_max_bytes: int = 256 * 4096 * 4
    # Tensor-parallel shutdown: abort (NCCL communicators aborted, fast) or destroy (NCCL's finalize).
    tp_teardown: str = "abort"

    def __post_init__(self) -> None:
        if self.symm_protocol not in ("auto", "ll", "pull"):
            raise ValueError(f"{PREFIX}SYMM_PROTOCOL={self.symm_protocol!r}: expected 'auto', 'll' or 'pull'")
        if self.tp_teardown not in ("abort", "destroy"):
            raise ValueError(f"{PREFIX}TP_TEARDOWN={self.tp_teardown!r}: expected 'abort' or 'destroy'")
        if self.symm_mem_max_bytes < 0:
            raise ValueError(f"{PREFIX}SYMM_MEM_MAX_BYTES={self.symm_mem_max_bytes}: must be >= 0")

    @staticmethod
    def env_name(field_name: str) -> str:
        return PREFIX + field_name.upper()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelSwitches:
        """The switches as the environment sets them (defaults for unset variables); warns
        about `NANOSERVE_*` variables that nothing declares. The process environment is
        parsed (and warned about) once per distinct set of `NANOSERVE_*` values."""
        env = os.environ if environ is None else environ
        ours = tuple(sorted((k, v) for k, v in env.items() if k.startswith(PREFIX)))
        return _switches_from(ours)

    def nondefault(self) -> dict[str, object]:
        """{environment variable: value} for every switch that differs from its default."""
        return {
            self.env_name(f.name): getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default
        }


# Settings that are not kernel switches, with what they set.
OTHER_VARIABLES = {
    "API_KEY": "the server's default --api-key",
    "CACHE": "folder for tokenizers extracted from GGUF files (default ~/.cache/nanoserve)",
}


def declared_names() -> set[str]:
    return {KernelSwitches.env_name(f.name) for f in fields(KernelSwitches)} | {PREFIX + n for n in OTHER_VARIABLES}


def warn_unknown(environ: Mapping[str, str]) -> list[str]:
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in declared_names())
    for name in unknown:
        log.warning("unknown environment variable %s ignored; known: %s", name, ", ".join(sorted(declared_names())))
    return unknown


@functools.lru_cache(maxsize=16)
def _switches_from(ours: tuple[tuple[str, str], ...]) -> KernelSwitches:
    env = dict(ours)
    warn_unknown(env)
    values = {}
    for f in fields(KernelSwitches):
        raw = env.get(KernelSwitches.env_name(f.name))
        if raw is not None:
            values[f.name] = _parse(KernelSwitches.env_name(f.name), raw, type(f.default))
    return KernelSwitches(**values)


_logged: set[KernelSwitches] = set()


def log_nondefault(switches: KernelSwitches) -> None:
    """Log the switches that differ from their defaults, once per distinct set per process."""
    if switches in _logged:
        return
    _logged.add(switches)
    changed = switches.nondefault()
    if changed:
        log.info("kernel switches differ from their defaults: %s", ", ".join(f"{k}={v}" for k, v in changed.items()))


def api_key_from_env() -> str | None:
    return os.environ.get(PREFIX + "API_KEY")


def cache_dir() -> Path:
    return Path(os.environ.get(PREFIX + "CACHE", Path.home() / ".cache" / "nanoserve"))


def _parse(name: str, raw: str, kind: type):
    text = raw.strip().lower()
    if kind is bool:
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"{name}={raw!r}: expected 1 or 0")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected an integer") from None
    return text
