"""EAGLE-3 drafting: one decoder layer over the target's own hidden states proposes the next tokens.

Owns: the EAGLE-3 checkpoint layout (`Eagle3Config`, `load_eagle3`, and `write_random_eagle3`
for tests and benchmarks), the draft module `Eagle3Draft`, and `Eagle3Proposer`, the drafter
the verify step (nanoserve.engine.speculative.step) asks for drafts.

Checkpoint layout (as SGLang and vLLM load `LlamaForCausalLMEagle3`): config.json with
architectures ["LlamaForCausalLMEagle3"], the layer's Llama shapes (hidden_size must be the
target's), draft_vocab_size, vocab_size (the target's), optionally
eagle_config.eagle_aux_hidden_state_layer_ids (default (2, L // 2, L - 3) for an L-layer target,
vLLM's choice) and norm_before_residual; tensors `fc.weight` [H, 3H], `midlayer.*` (one Llama
layer whose q/k/v take 2H inputs and which has a `hidden_norm`), `norm.weight`,
`lm_head.weight` [draft_vocab, H], `d2t` [draft_vocab] (target id = draft id + d2t[draft id]),
optionally `t2d` [vocab] (checked against d2t) and `embed_tokens.weight` (else the target's
embedding is shared).

The draft layer at position i reads the target's feature of position i (the residual stream
entering the three aux layers, concatenated and projected by `fc`) and the embedding of token
i + 1, and predicts token i + 2:
    e = input_layernorm(embed(token)), h = hidden_norm(hidden), residual = hidden (or h with
    norm_before_residual); x = attention(cat(e, h)) with its own one-layer paged KV cache;
    x, residual = post_attention_layernorm(x, residual); x = mlp(x);
    logits = lm_head(norm(x + residual)); the next draft step's hidden is x + residual (no fc).

Drafting (chain, per verify step): the target writes its features for every position it
computes into the feature cache (nanoserve.kvcache.features), on the KV cache's pages. For
each request the proposer keeps `dc`, the positions its draft KV covers from target features.
`propose` first catches up: one extend over positions [dc, n) (n = num_computed; position
n - 1 pairs the last computed feature with the last token, not yet computed), whose last row
gives draft token 1; then budget - 1 decode steps at positions n, n + 1, ... feed back the
layer's own pre-norm output. Their KV is not target-fed, so `dc` stays n and the next catch-up
recomputes those positions with the accepted tokens' features. Invariants:
- dc <= num_computed after `verified`; a request whose pages were released (preemption: the
  scheduler gives it a new page list) or whose dc passed its num_computed restarts from 0;
- draft K/V of position p sit at the target's slot of p, so the pages that
  `Scheduler.reserve_lookahead` reserves for the drafts hold them too; a page copy (forks of
  n > 1) copies the features and the draft K/V with the target's;
- drafts are target ids (draft id + d2t); greedy requests draft by argmax (Draft.probs None),
  sampling ones draw from the draft's distribution processed as the sampler processes the
  request's row (penalties, temperature, top-k, top-p, min-p) on the target vocabulary,
  returned as Draft.probs for the rejection rule (zero outside the draft vocabulary).
Draft forwards run through their own instance of the target's attention backend; the decode
steps replay CUDA graphs (nanoserve.engine.speculative.draft_graphs) where the target has
decode graphs; so does the catch-up, as one decode row per position (row p attends to the
request's positions up to p, those the same forward writes included), where its rows fit.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from nanoserve.attention import get_backend
from nanoserve.attention.base import ForwardBatch
from nanoserve.config import MAX_DRAFT_TOKENS, SpeculativeConfig
from nanoserve.distributed import SINGLE
from nanoserve.engine.speculative.acceptance import target_distributions
from nanoserve.engine.speculative.draft_graphs import DraftDecodeGraphs
from nanoserve.engine.speculative.proposer import Draft, DraftContext
from nanoserve.kvcache.features import FeatureCache
from nanoserve.kvcache.pool import KVCache
from nanoserve.models.decoder import MLP, Attention
from nanoserve.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowSlice,
    VocabParallelEmbedding,
    apply_switches,
)
from nanoserve.models.loader import load_weights, safetensors_checkpoint
from nanoserve.models.model_config import ModelConfig
from nanoserve.scheduler.scheduler import ScheduledBatch
from nanoserve.switches import KernelSwitches

if TYPE_CHECKING:
    from nanoserve.scheduler.request import Request

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # SGLang's name, vLLM's alias
NUM_AUX_LAYERS = 3  # low, mid and high features


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    model: ModelConfig  # the draft layer's shapes (one Llama layer)
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # target layers whose entering residual stream is a feature
    norm_before_residual: bool

    @staticmethod
    def load(path: str | Path, target: ModelConfig) -> Eagle3Config:
        """The checkpoint's config, checked against the target; ValueError says what is wrong."""
        directory = Path(path)
        file = directory / "config.json"
        if not file.is_file():
            raise ValueError(f"speculative_draft_model: no EAGLE-3 checkpoint at {str(path)!r} (no config.json)")
        raw = json.loads(file.read_text())
        arch = raw.get("architectures") or []
        if not any(a in ARCHITECTURES for a in arch):
            raise ValueError(
                f"speculative_draft_model {str(path)!r} is not an EAGLE-3 checkpoint: architectures {arch}, "
                f"expected one of {list(ARCHITECTURES)}"
            )
        if raw.get("hidden_size") != target.hidden_size:
            raise ValueError(
                f"EAGLE-3 checkpoint {str(path)!r} has hidden_size {raw.get('hidden_size')}, "
                f"the target model {target.hidden_size}: it was trained for another model"
            )
        vocab = raw.get("vocab_size", target.vocab_size)
        if vocab != target.vocab_size:
            raise ValueError(
                f"EAGLE-3 checkpoint {str(path)!r} has vocab_size {vocab}, the target model {target.vocab_size}"
            )
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE-3 checkpoints have one draft layer; {str(path)!r} has {raw['num_hidden_layers']}")
        draft_vocab = raw.get("draft_vocab_size") or vocab
        if not 1 <= draft_vocab <= vocab:
            raise ValueError(f"EAGLE-3 draft_vocab_size {draft_vocab} must be in [1, vocab_size {vocab}]")
        eagle = raw.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(int(i) for i in aux) if aux else default_aux_layers(target.num_layers)
        if len(aux) != NUM_AUX_LAYERS or not all(0 <= i < target.num_layers for i in aux):
            raise ValueError(
                f"EAGLE-3 aux hidden-state layers {list(aux)} must be {NUM_AUX_LAYERS} layer ids of the "
                f"{target.num_layers}-layer target (set eagle_config.eagle_aux_hidden_state_layer_ids)"
            )
        model = ModelConfig.from_hf_dict({**raw, "model_type": "llama", "num_hidden_layers": 1}, str(path))
        return Eagle3Config(model, draft_vocab, aux, bool(raw.get("norm_before_residual", False)))

    def bytes_per_token(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
        """What the drafter keeps per KV-cache token: the target's features and its own K/V."""
        m = self.model
        return FeatureCache.bytes_per_token(len(self.aux_layers), m.hidden_size, dtype) + KVCache.bytes_per_token(
            1, m.num_kv_heads, m.head_dim, kv_dtype
        )


class Eagle3Layer(nn.Module):
    """The draft's decoder layer: a Llama layer whose attention reads [embedding, feature] (2H)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg, 0, SINGLE)
        self.self_attn.qkv_proj = ColumnParallelLinear(2 * h, self.self_attn.qkv_proj.parts, bias=cfg.qkv_bias)
        self.mlp = MLP(cfg, SINGLE)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)


# checkpoint names -> our merged linears (as DecoderLM merges them)
_MERGED = (
    ("self_attn.q_proj", "self_attn.qkv_proj", "q"),
    ("self_attn.k_proj", "self_attn.qkv_proj", "k"),
    ("self_attn.v_proj", "self_attn.qkv_proj", "v"),
    ("mlp.gate_proj", "mlp.gate_up_proj", "gate"),
    ("mlp.up_proj", "mlp.gate_up_proj", "up"),
)


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft module (see the module docstring for its forward)."""

    def __init__(
        self,
        ec: Eagle3Config,
        max_positions: int,
        target_embedding: VocabParallelEmbedding | None,
        switches: KernelSwitches | None = None,
    ):
        super().__init__()
        cfg = ec.model
        h = cfg.hidden_size
        self.config = ec
        self.fc = ColumnParallelLinear(len(ec.aux_layers) * h, [RowSlice(None, 0, h)], bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(ec.draft_vocab_size, h)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # Its own embedding when the checkpoint has one, else the target's (not a submodule:
        # the target owns and loads it).
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h) if target_embedding is None else None
        self._shared_embedding = (target_embedding,)
        # draft id -> target id (draft id + d2t), filled by `load_eagle3`
        self.register_buffer("draft_to_target", torch.arange(ec.draft_vocab_size), persistent=False)
        if switches is not None:
            apply_switches(self, switches)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self._shared_embedding[0]
        return table(ids)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated features [T, 3H] as the layer's hidden input [T, H]."""
        return self.fc(features)

    def forward(
        self, positions: torch.Tensor, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm output, final-normed output), each [T, H], of rows (token, hidden) at
        `positions`; the rows' K/V go to `batch`'s one-layer cache at its slot_mapping."""
        layer = self.midlayer
        embeds = layer.input_layernorm(self.embed(input_ids))
        normed_hidden = layer.hidden_norm(hidden)
        residual = normed_hidden if self.config.norm_before_residual else hidden
        x = torch.cat([embeds, normed_hidden], dim=-1)
        attn = layer.self_attn
        q, k, v = attn.before_attention(positions, x, self.rotary, batch.kv_sink(0))
        out = attn.after_attention(batch.attend(0, q, k, v, attn.scale, kv_stored=True))
        out, residual = layer.post_attention_layernorm(out, residual)
        normed, prenorm = self.norm(layer.mlp(out), residual)
        return prenorm, normed

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [T, draft_vocab]."""
        return self.lm_head.logits(normed)

    def checkpoint_target(self, hf_name: str) -> tuple[str, str | None] | None:
        """(our parameter name, shard id) of a checkpoint tensor (see `load_weights`)."""
        name = hf_name.removeprefix("model.")
        for src, dst, shard in _MERGED:
            if src in name:
                return name.replace(src, dst), shard
        return name, None


def load_eagle3(
    path: str | Path,
    ec: Eagle3Config,
    target_embedding: VocabParallelEmbedding,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    switches: KernelSwitches | None = None,
) -> Eagle3Draft:
    """The draft module of the checkpoint at `path`, every tensor loaded (a missing or
    unexpected one is an error), d2t checked against the target vocabulary."""
    directory = Path(path)
    tensors = dict(safetensors_checkpoint(directory))
    tensors = {name.removeprefix("model."): t for name, t in tensors.items()}
    own_embedding = "embed_tokens.weight" in tensors
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            draft = Eagle3Draft(ec, max_positions, None if own_embedding else target_embedding, switches)
    finally:
        torch.set_default_dtype(previous)
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    draft.draft_to_target.copy_(_draft_to_target(ec, d2t, t2d, str(path)))
    load_weights(draft, iter(tensors.items()))
    return draft.eval()


def _draft_to_target(ec: Eagle3Config, d2t: torch.Tensor | None, t2d: torch.Tensor | None, where: str) -> torch.Tensor:
    """Target ids of the draft vocabulary, checked: distinct ids inside the target vocabulary,
    and t2d (when given) marking exactly them."""
    n, vocab = ec.draft_vocab_size, ec.model.vocab_size
    if d2t is None:
        if n != vocab:
            raise ValueError(
                f"EAGLE-3 checkpoint {where!r}: draft_vocab_size {n} < vocab_size {vocab} needs a d2t tensor"
            )
        return torch.arange(n)
    if tuple(d2t.shape) != (n,):
        raise ValueError(f"EAGLE-3 checkpoint {where!r}: d2t has shape {tuple(d2t.shape)}, expected ({n},)")
    ids = torch.arange(n) + d2t.long().cpu()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != n:
        raise ValueError(
            f"EAGLE-3 checkpoint {where!r}: d2t maps draft ids outside or twice onto the target vocabulary"
        )
    if t2d is not None:
        t2d = t2d.bool().cpu()
        if tuple(t2d.shape) != (vocab,) or int(t2d.sum()) != n or not bool(t2d[ids].all()):
            raise ValueError(f"EAGLE-3 checkpoint {where!r}: t2d does not mark the target ids that d2t gives")
    return ids


def write_random_eagle3(
    directory: str | Path,
    target: ModelConfig | dict,
    draft_vocab_size: int,
    seed: int = 0,
    *,
    aux_layers: tuple[int, ...] | None = None,
    own_embedding: bool = False,
    norm_before_residual: bool = False,
    dtype: torch.dtype = torch.float32,
    rope_theta: float | None = None,
) -> Path:
    """A random-weight EAGLE-3 checkpoint of the real layout for `target` (a ModelConfig or its
    Hugging Face config dict): the target's attention and MLP shapes, a d2t mapping onto a
    random subset of `draft_vocab_size` target ids (all of them when equal), t2d beside it."""
    if isinstance(target, dict):
        target = ModelConfig.from_hf_dict(target)
    h, vocab = target.hidden_size, target.vocab_size
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab}], got {draft_vocab_size}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    d, hq, hk, inter = target.head_dim, target.num_heads, target.num_kv_heads, target.intermediate_size

    def rand(*shape: int) -> torch.Tensor:  # fan-in scaled, so activations keep their size
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dtype)

    ids = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": rand(h, NUM_AUX_LAYERS * h),
        "midlayer.input_layernorm.weight": torch.ones(h, dtype=dtype),
        "midlayer.hidden_norm.weight": torch.ones(h, dtype=dtype),
        "midlayer.self_attn.q_proj.weight": rand(hq * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(hk * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(hk * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, hq * d),
        "midlayer.post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": rand(draft_vocab_size, h),
        "d2t": ids - torch.arange(draft_vocab_size),
        "t2d": t2d,
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = torch.randn(vocab, h, generator=gen).to(dtype)
    config = {
        "architectures": [ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": h,
        "num_attention_heads": hq,
        "num_key_value_heads": hk,
        "head_dim": d,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta if rope_theta is None else rope_theta,
        "rope_scaling": target.rope_scaling,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "norm_before_residual": norm_before_residual,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


# ---- the proposer ------------------------------------------------------------------------


@dataclass
class _DraftState:
    dc: int  # positions [0, dc) hold draft K/V computed from target features
    pages: list[int]  # the request's page list when dc was set (a new list: its pages were released)


class _Shifted:
    """A request's tokens one position on: the draft's input at position i is token i + 1."""

    __slots__ = ("ids",)

    def __init__(self, ids: list[int]):
        self.ids = ids

    def __getitem__(self, s: slice) -> list[int]:
        return self.ids[s.start + 1 : s.stop + 1]


class _Placeholders:
    """Input ids of draft decode rows, which come from the device instead (0 here)."""

    def __getitem__(self, s: slice) -> list[int]:
        return [0] * (s.stop - s.start)


@dataclass
class _Rows:
    """What `ModelRunner.prepare` reads of a request, for a draft forward over its positions
    [num_computed, num_computed + count) at its own slot's pages."""

    num_computed: int
    slot: int
    token_ids: object


MAX_GRAPH_ROWS = 256  # the draft graphs' largest batch of rows (larger catch-ups run eagerly)


class Eagle3Proposer:
    """Chain drafts from an EAGLE-3 checkpoint (see the module docstring): attaches the
    feature cache to the target at start, keeps each request's draft coverage `dc`."""

    needs_pages = True

    def __init__(self, spec: SpeculativeConfig, context: DraftContext):
        """Checks the checkpoint against the target (before the KV plan, which counts the
        features and the draft's K/V per token); `attach` loads it once the engine is built."""
        if context.config.tensor_parallel_size > 1:
            raise ValueError("speculative_algorithm='eagle3' runs with tensor_parallel_size=1 only")
        self.spec = spec
        self.config = Eagle3Config.load(spec.draft_model, context.target_source.config)
        self.kv_bytes_per_token = self.config.bytes_per_token(context.dtype, context.kv_dtype)

    def attach(self, engine, plan) -> None:
        """Load the draft, give it a KV cache on the target's pages and attach the feature cache
        to the target's forward (before the target's graphs are captured)."""
        spec = self.spec
        runner = engine.runner
        target = engine.model_config
        ec = self.config
        self.engine = engine
        device = engine.device
        self.draft = load_eagle3(
            spec.draft_model,
            ec,
            runner.model.embed_tokens,
            engine.max_model_len,
            engine.dtype,
            device,
            engine.config.switches,
        )
        kv = runner.kv_cache
        self.page_size = kv.page_size
        m = ec.model
        self.kv = KVCache(1, kv.num_pages, kv.page_size, m.num_kv_heads, m.head_dim, engine.kv_dtype, device)
        cfg = engine.config
        # The draft's own backend instance: per-batch state and the decode workspace stay the
        # target's (its captured decode graphs hold that workspace; a draft batch must never
        # make the target's backend reallocate it).
        self.backend = get_backend(runner.backend.name, device, max_num_reqs=cfg.max_num_seqs, switches=cfg.switches)
        # the most rows one target forward computes: a prefill or mixed step's budget, or a
        # verify step of every sequence with the most drafts a step may verify
        max_rows = max(cfg.chunked_prefill_size, cfg.mixed_step_budget(), cfg.max_num_seqs * (1 + MAX_DRAFT_TOKENS))
        self.features = FeatureCache(
            ec.aux_layers, target.hidden_size, kv.num_pages * kv.page_size, max_rows, engine.dtype, device
        )
        runner.model.feature_sink = self.features
        sched = engine.scheduler
        copy_target = sched.copy_page

        def copy_page(src: int, dst: int) -> None:  # a fork's partial page: features and draft K/V too
            copy_target(src, dst)
            self.features.copy_page(src, dst, self.page_size)
            self.kv.copy_page(src, dst)

        sched.copy_page = copy_page
        self.vocab_size = target.vocab_size
        self.generator = torch.Generator(device=device).manual_seed(cfg.seed + 2)
        self.states: dict[Request, _DraftState] = {}
        self.num_draft_forwards = 0  # draft forwards run (catch-ups and decode steps), for tests and benchmarks
        self.num_restarts = 0  # drafts started over from position 0 (the request's pages were released)
        # The draft decode steps' CUDA graphs (where the target has decode graphs: CUDA, Triton
        # attention, not eager), up to the largest batch that speculates.
        self.graphs = None
        graphs_on = device.type == "cuda" and not cfg.enforce_eager and cfg.cuda_graph_max_bs != 0
        if graphs_on and runner.backend.name == "triton":
            # rows: a catch-up's positions, up to 1 + k per request that speculates
            requests = min(cfg.max_num_seqs, spec.disable_batch_size, cfg.cuda_graph_max_bs or cfg.max_num_seqs)
            max_bs = min(requests * (1 + spec.k), MAX_GRAPH_ROWS)
            self.graphs = DraftDecodeGraphs(
                self.draft, self.backend, self.kv, max_bs, engine.max_model_len, kv.page_size, engine.dtype, device
            )
            self.graphs.capture()

    # ---- the Proposer interface ----------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: list[Request], budgets: list[int]) -> list[Draft]:
        """Up to budgets[i] drafts for reqs[i] (decoding requests, pages reserved): one
        catch-up extend over every request, then one draft decode step per further token."""
        for req in [r for r in self.states if r.is_finished]:
            del self.states[req]
        drafts = [Draft([]) for _ in reqs]
        active = [i for i, b in enumerate(budgets) if b > 0]
        if not active:
            return drafts
        rows = [reqs[i] for i in active]
        ks = [budgets[i] for i in active]
        ends = [r.num_computed for r in rows]  # n: features exist for positions [0, n)
        starts = [min(self._state(r).dc, n - 1) for r, n in zip(rows, ends)]
        # Catch-up: positions [dc, n), each reading its feature and the token after it.
        counts = [n - s for n, s in zip(ends, starts)]
        graphs = self.graphs if self.graphs is not None and self.graphs.padded_size(sum(counts)) else None
        if graphs is not None:  # a decode row per position (each sees the rows before it): a graph
            inputs = self._prepare(
                [_Rows(p, r.slot, _Shifted(r.token_ids)) for r, s, n in zip(rows, starts, ends) for p in range(s, n)],
                [1] * sum(counts),
                is_decode=False,
            )
            hidden = self.draft.project(self.features.gather(inputs.meta.slot_mapping))
            prenorm, logits = graphs.step(inputs, inputs.input_ids, hidden)
            last = torch.tensor(list(itertools.accumulate(counts)), device=logits.device) - 1
            prenorm, logits = prenorm[last], logits[last]  # each request's last row drafts
            self.num_draft_forwards += 1
        else:
            inputs = self._prepare(
                [_Rows(s, r.slot, _Shifted(r.token_ids)) for r, s in zip(rows, starts)], counts, False
            )
            hidden = self.draft.project(self.features.gather(inputs.meta.slot_mapping))
            prenorm, normed = self._forward(inputs, inputs.input_ids, hidden)
            if inputs.logit_rows is not None:  # each request's last row drafts
                prenorm, normed = prenorm[inputs.logit_rows], normed[inputs.logit_rows]
            logits = self.draft.logits(normed)
        for r, n in zip(rows, ends):
            state = self.states[r]
            state.dc, state.pages = n, r.pages
        live = list(range(len(rows)))  # indices into rows still drafting
        ids, probs = self._choose(rows, live, logits)
        steps = [(live, ids, probs)]
        for j in range(1, max(ks)):
            keep = [a for a in live if ks[a] > j]
            if len(keep) < len(live):
                sel = torch.tensor([live.index(a) for a in keep], device=ids.device)
                ids, prenorm = ids[sel], prenorm[sel]
            live = keep
            inputs = self._prepare(
                [_Rows(ends[a] + j - 1, rows[a].slot, _Placeholders()) for a in live], [1] * len(live), is_decode=True
            )
            if self.graphs is not None and self.graphs.padded_size(len(live)) is not None:
                prenorm, logits = self.graphs.step(inputs, ids, prenorm)
                self.num_draft_forwards += 1
            else:
                prenorm, normed = self._forward(inputs, ids, prenorm)
                logits = self.draft.logits(normed)
            ids, probs = self._choose(rows, live, logits)
            steps.append((live, ids, probs))
        tokens: list[list[int]] = [[] for _ in rows]
        dists: list[list[torch.Tensor]] = [[] for _ in rows]
        for live, ids, probs in steps:
            for a, token in zip(live, ids.tolist()):
                tokens[a].append(token)
                if probs is not None and a in probs:
                    dists[a].append(probs[a])
        for a, i in enumerate(active):
            drafts[i] = Draft(tokens[a], torch.stack(dists[a]) if dists[a] else None)
        return drafts

    def verified(self, reqs: list[Request]) -> None:
        for req in reqs:
            state = self.states.get(req)
            if state is not None:
                state.dc = min(state.dc, req.num_computed)

    def finished(self, req: Request) -> None:
        self.states.pop(req, None)

    # ---- parts -------------------------------------------------------------------------

    def _state(self, req: Request) -> _DraftState:
        state = self.states.get(req)
        if state is None or state.pages is not req.pages or state.dc > req.num_computed:
            self.num_restarts += state is not None
            state = self.states[req] = _DraftState(0, req.pages)
        return state

    def _prepare(self, rows: list[_Rows], counts: list[int], is_decode: bool):
        """The runner's inputs for a draft forward over these positions (metadata, slots and
        positions as for the target: the draft's K/V share its slots)."""
        # always the extend path (single-token rows included): the target's decode graphs'
        # static inputs stay untouched; its logit rows are each request's last position
        batch = ScheduledBatch(rows, counts, False, self.engine.scheduler.page_table)
        return self.engine.runner.prepare(batch, list(range(len(rows))))

    def _forward(self, inputs, input_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        backend = self.backend
        backend.prepare(inputs.meta)
        batch = ForwardBatch(inputs.meta, backend, self.kv.k, self.kv.v)
        self.num_draft_forwards += 1
        return self.draft(inputs.positions, input_ids, hidden, batch)

    def _choose(
        self, rows: list[Request], live: list[int], logits: torch.Tensor
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
        """Each live row's draft token (a target id, on the device) and, for rows of sampling
        requests, the target-vocabulary distribution it was drawn from (by index into rows)."""
        to_target = self.draft.draft_to_target
        ids = to_target[logits.argmax(dim=-1)]
        sampled = [r for r, a in enumerate(live) if not rows[a].params.greedy]
        if not sampled:
            return ids, None
        full = logits.new_full((len(sampled), self.vocab_size), float("-inf"), dtype=torch.float32)
        full[:, to_target] = logits[sampled].float()
        sample_rows = [self.engine._sample_row(rows[live[r]]) for r in sampled]
        probs = target_distributions(full, sample_rows, None)[1]
        out = {}
        for j, r in enumerate(sampled):
            req = rows[live[r]]
            gen = req.generator if req.generator is not None else self.generator
            ids[r] = torch.multinomial(probs[j], 1, generator=gen)[0]
            out[live[r]] = probs[j]
        return ids, out
