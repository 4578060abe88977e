"""EAGLE-3 drafting (nanoserve.engine.speculative.eagle3): the draft layer against a plain torch
reference, the checkpoint layout and its checks, the target's feature cache against Hugging
Face's hidden states (eager and through the piecewise path's pieces), and greedy output
identical to speculation off with drafts that are accepted often (a draft built to follow a
tiny target whose layers add little to its embedding), with the prefix cache, preemption,
forks and the piecewise path; sampled drafts are drawn from the distribution they report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from nanoserve.attention.base import AttentionMetadata, ForwardBatch
from nanoserve.attention.torch_backend import TorchAttentionBackend
from nanoserve.engine.piecewise_graph import PiecewiseGraphs, piecewise_sizes
from nanoserve.engine.speculative.eagle3 import Eagle3Config, load_eagle3, write_random_eagle3
from nanoserve.kvcache.pool import KVCache
from nanoserve.llm import LLM
from nanoserve.models.layers import VocabParallelEmbedding
from nanoserve.models.model_config import ModelConfig
from nanoserve.sampling_params import SamplingParams
from tests.tiny import VOCAB, tiny_config

DRAFT_VOCAB = 384  # of the target's 512


def target_config() -> dict:
    """A tiny Llama with 4 layers (the default aux layers are 2, 2, 1) and no GQA."""
    cfg = tiny_config("llama")
    cfg.update(num_hidden_layers=4, num_key_value_heads=4)
    return cfg


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("eagle3")
    spec = target_config()
    model_type = spec.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **spec), dtype=torch.float32)
    # A large embedding and small layer outputs: the target's next token then depends mostly
    # on its current one, which a one-layer draft can follow (`aligned_draft`); about 40% of
    # its tokens still break that rule, so drafts are rejected too.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    model.save_pretrained(str(root / "target"))
    write_random_eagle3(root / "random", target_config(), DRAFT_VOCAB, seed=1)
    aligned_draft(root / "target", root / "aligned")
    return {"target": root / "target", "random": root / "random", "aligned": root / "aligned", "root": root}


def aligned_draft(target_dir: Path, directory: Path) -> None:
    """An EAGLE-3 checkpoint whose layer copies its input token's embedding (attention sharply
    peaked on rows of the same token, v = the embedding) into the target's own final norm and
    lm_head rows: it predicts what the target's embedding alone would, restricted to the draft
    vocabulary. The target features still enter, through fc and a small hidden_norm."""
    write_random_eagle3(directory, target_config(), DRAFT_VOCAB, seed=2, norm_before_residual=True, rope_theta=1e12)
    target = load_file(str(target_dir / "model.safetensors"))
    t = load_file(str(directory / "model.safetensors"))
    h = target_config()["hidden_size"]
    eye = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)  # the embedding half of [embedding, feature]
    t["midlayer.self_attn.q_proj.weight"] = 4.0 * eye
    t["midlayer.self_attn.k_proj.weight"] = 4.0 * eye
    t["midlayer.self_attn.v_proj.weight"] = eye.clone()
    t["midlayer.self_attn.o_proj.weight"] = torch.eye(h)
    t["midlayer.hidden_norm.weight"] = torch.full((h,), 0.01)
    t["midlayer.mlp.down_proj.weight"] *= 0.01
    t["norm.weight"] = target["model.norm.weight"].clone()
    ids = torch.arange(DRAFT_VOCAB) + t["d2t"]
    t["lm_head.weight"] = target["lm_head.weight"][ids].clone()
    save_file(t, str(directory / "model.safetensors"))


# ---- the draft layer against a plain reference -------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions[:, None].float() * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # [T, 1, d/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_layer(t: dict, cfg: dict, embeds: torch.Tensor, hidden: torch.Tensor, before: bool):
    """EAGLE-3's layer over one whole sequence (positions 0..T-1), causal: (prenorm, normed, logits)."""
    eps, heads, kv_heads = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // heads
    n = embeds.shape[0]
    e = rms(embeds, t["midlayer.input_layernorm.weight"], eps)
    hn = rms(hidden, t["midlayer.hidden_norm.weight"], eps)
    residual = hn if before else hidden
    x = torch.cat([e, hn], dim=-1)
    pos = torch.arange(n)
    q = rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d), pos, cfg["rope_theta"])
    k = rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, d), pos, cfg["rope_theta"])
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, d)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    s = attn @ t["midlayer.self_attn.o_proj.weight"].T + residual
    m = rms(s, t["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)) @ t[
        "midlayer.mlp.down_proj.weight"
    ].T
    prenorm = mlp + s
    normed = rms(prenorm, t["norm.weight"], eps)
    return prenorm, normed, normed @ t["lm_head.weight"].T


def paged_meta(prefix: int, count: int, pages: list[int], page_size: int) -> AttentionMetadata:
    positions = torch.arange(prefix, prefix + count)
    table = torch.tensor([pages], dtype=torch.int32)
    slots = table[0, positions // page_size].long() * page_size + positions % page_size
    return AttentionMetadata(
        is_decode=count == 1,
        seq_lens=torch.tensor([prefix + count], dtype=torch.int32),
        prefix_lens=torch.tensor([prefix], dtype=torch.int32),
        cu_query_lens=torch.tensor([0, count], dtype=torch.int32),
        page_table=table,
        slot_mapping=slots,
        seq_lens_host=[prefix + count],
        prefix_lens_host=[prefix],
        max_query_len=count,
        max_seq_len=prefix + count,
    )


@pytest.mark.parametrize("variant", ["shared_embedding", "own_embedding_norm_before_residual"])
def test_draft_layer_matches_reference(tmp_path, variant):
    cfg = target_config()
    own = variant != "shared_embedding"
    path = write_random_eagle3(tmp_path, cfg, DRAFT_VOCAB, seed=3, own_embedding=own, norm_before_residual=own)
    target = ModelConfig.from_hf_dict(cfg)
    ec = Eagle3Config.load(path, target)
    assert ec.aux_layers == (2, 2, 1) and ec.draft_vocab_size == DRAFT_VOCAB
    embedding = VocabParallelEmbedding(VOCAB, cfg["hidden_size"])
    torch.nn.init.normal_(embedding.weight)
    draft = load_eagle3(path, ec, embedding, 64, torch.float32, torch.device("cpu"))
    t = load_file(str(path / "model.safetensors"))
    table = t["embed_tokens.weight"] if own else embedding.weight.detach()

    torch.manual_seed(0)
    n, page_size, pages = 11, 4, [3, 1, 5]
    ids = torch.randint(0, VOCAB, (n,))
    features = torch.randn(n, 3 * cfg["hidden_size"])
    hidden = features @ t["fc.weight"].T
    draft_cfg = json.loads((path / "config.json").read_text())
    ref_pre, ref_normed, ref_logits = reference_layer(t, draft_cfg, table[ids], hidden, before=own)

    kv = KVCache(1, 8, page_size, cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"],
                 torch.float32, torch.device("cpu"))  # fmt: skip
    backend = TorchAttentionBackend()
    with torch.inference_mode():
        got_pre, got_normed = [], []
        for start, count in ((0, 8), (8, 1), (9, 2)):  # an extend, a decode row, an extend over the paged prefix
            meta = paged_meta(start, count, pages, page_size)
            backend.prepare(meta)
            rows = slice(start, start + count)
            h = draft.project(features[rows])
            pre, normed = draft(
                torch.arange(start, start + count), ids[rows], h, ForwardBatch(meta, backend, kv.k, kv.v)
            )
            got_pre.append(pre)
            got_normed.append(normed)
        got_pre, got_normed = torch.cat(got_pre), torch.cat(got_normed)
        torch.testing.assert_close(got_pre, ref_pre, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_normed, ref_normed, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(draft.logits(got_normed), ref_logits, rtol=1e-4, atol=1e-5)
    assert torch.equal(draft.draft_to_target, torch.arange(DRAFT_VOCAB) + t["d2t"])


# ---- the checkpoint's checks -------------------------------------------------------------


def edit_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_checkpoint_checks(models, tmp_path):
    target = ModelConfig.from_hf_dict(target_config())
    random = models["random"]
    cfg = json.loads((random / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    t = load_file(str(random / "model.safetensors"))
    ids = torch.arange(DRAFT_VOCAB) + t["d2t"]
    assert ids.unique().numel() == DRAFT_VOCAB and int(ids.max()) < VOCAB and DRAFT_VOCAB < VOCAB  # a real subset
    assert torch.equal(t["t2d"].nonzero()[:, 0], ids)
    with pytest.raises(ValueError, match="not an EAGLE-3 checkpoint"):
        Eagle3Config.load(edit_config(random, tmp_path / "arch", architectures=["LlamaForCausalLM"]), target)
    with pytest.raises(ValueError, match="hidden_size 96, the target model 64"):
        Eagle3Config.load(edit_config(random, tmp_path / "hidden", hidden_size=96), target)
    with pytest.raises(ValueError, match="aux hidden-state layers"):
        Eagle3Config.load(
            edit_config(random, tmp_path / "aux", eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 4]}), target
        )
    aux = edit_config(random, tmp_path / "aux_ok", eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]})
    assert Eagle3Config.load(aux, target).aux_layers == (0, 1, 3)
    with pytest.raises(ValueError, match="no EAGLE-3 checkpoint"):
        Eagle3Config.load(tmp_path / "missing", target)
    # a d2t that maps two draft ids onto one target id
    bad = edit_config(random, tmp_path / "d2t", draft_vocab_size=DRAFT_VOCAB)
    t2 = dict(t)
    t2["d2t"] = t["d2t"].clone()
    t2["d2t"][1] = ids[0] - 1
    save_file(t2, str(bad / "model.safetensors"))
    ec = Eagle3Config.load(bad, target)
    embedding = VocabParallelEmbedding(VOCAB, target.hidden_size)
    with pytest.raises(ValueError, match="d2t maps draft ids"):
        load_eagle3(bad, ec, embedding, 64, torch.float32, torch.device("cpu"))
    # the KV plan's share: 3 features of H and one layer's K and V, per token
    assert Eagle3Config.load(random, target).bytes_per_token(torch.float32, torch.float32) == (3 * 64 + 2 * 64) * 4
    # refused at start by the engine, before anything serves
    wrong = edit_config(random, tmp_path / "hidden_llm", hidden_size=96)
    with pytest.raises(ValueError, match="hidden_size 96"):
        LLM(str(models["target"]), device="cpu", speculative_algorithm="eagle3", speculative_draft_model=str(wrong))


# ---- the target's features ---------------------------------------------------------------


@pytest.mark.parametrize("path", ["eager", "piecewise"])
def test_feature_cache_holds_hf_hidden_states(models, path):
    """The stream entering each aux layer, at every prompt position: written by the eager
    forward, and by the piecewise path's pieces on padded static buffers (run uncaptured)."""
    from transformers import AutoModelForCausalLM

    llm = LLM(
        str(models["target"]), device="cpu", dtype="float32", kv_cache_tokens=512, page_size=4,
        speculative_algorithm="eagle3", speculative_cost_gate=False, speculative_draft_model=str(models["random"]),
    )  # fmt: skip
    eng = llm.engine
    if path == "piecewise":
        use_piecewise(llm)
    prompt = [(7 * i + 3) % VOCAB for i in range(13)]
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), stream=False)
    eng.step()  # the prompt's prefill
    req = eng.scheduler.running[0]
    pos = torch.arange(len(prompt))
    slots = torch.tensor(req.pages)[pos // 4] * 4 + pos % 4
    features = eng.speculator.proposer.features
    got = features.data[slots]  # [T, 3, H]
    hf = AutoModelForCausalLM.from_pretrained(str(models["target"]), dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states  # [i]: entering layer i
    for j, layer in enumerate(features.layers):
        torch.testing.assert_close(got[:, j], states[layer][0], rtol=1e-4, atol=1e-5)
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_invariants()
    if path == "piecewise":
        assert eng.runner.piecewise.replays[16] > 0  # 13 prompt tokens, padded


def use_piecewise(llm: LLM) -> None:
    """Route `llm`'s prefill and verify batches of up to 256 tokens through the piecewise
    graphs' pieces (uncaptured on CPU: each piece's body on the padded static buffers)."""
    runner = llm.engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model, piecewise_sizes(256), runner.device, torch.float32)


# ---- lossless end to end -----------------------------------------------------------------


def prompts() -> list[list[int]]:
    return [
        [5, 9, 5, 9, 5, 9, 5, 9, 5, 9],
        [(3 * i) % VOCAB for i in range(40)],
        [11] * 24,
        [100, 200, 300, 400, 500, 100, 200, 300],
        list(range(60, 75)) * 2,
    ]


GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def tokens(llm: LLM, ps: list[list[int]], params=GREEDY) -> list[list[int]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(ps, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(models) -> list[list[list[int]]]:
    llm = LLM(str(models["target"]), device="cpu", dtype="float32", kv_cache_tokens=2048)
    return tokens(llm, prompts())


@pytest.mark.parametrize(
    "case",
    [
        "aligned_prefix_cache",  # the accepting draft; a second pass hits the prefix cache
        "random_page1_k6",  # a random draft (rarely accepted), page size 1, more drafts
        "aligned_preempting",  # a KV cache too small for all: requests are preempted and recomputed
        "aligned_piecewise",  # prefill and verify batches through the piecewise path's padded pieces
    ],
)
def test_greedy_identical_to_speculation_off(models, reference, case):
    args = {"kv_cache_tokens": 2048}
    draft = models["aligned" if case.startswith("aligned") else "random"]
    if case == "random_page1_k6":
        args.update(page_size=1, speculative_num_draft_tokens=6)
    if case == "aligned_preempting":
        args.update(kv_cache_tokens=16 * 10, page_size=16, chunked_prefill_size=32)
    llm = LLM(
        str(models["target"]), device="cpu", dtype="float32", speculative_algorithm="eagle3", speculative_cost_gate=False,
        speculative_draft_model=str(draft), **args,
    )  # fmt: skip
    if case == "aligned_piecewise":
        use_piecewise(llm)
    ps = prompts()
    assert tokens(llm, ps) == reference
    llm.engine.check_invariants()
    if case == "aligned_piecewise":
        assert sum(llm.engine.runner.piecewise.replays.values()) >= 1  # the prompts (verify steps are decode rows)
    stats = llm.stats()
    drafted, accepted = stats["vllm:spec_decode_num_draft_tokens"], stats["vllm:spec_decode_num_accepted_tokens"]
    assert drafted > 0
    if case.startswith("aligned"):
        # the draft follows the target often: the check above compared many accepted runs
        per_pos = stats["vllm:spec_decode_num_accepted_tokens_per_pos"]
        assert accepted >= drafted // 8 and per_pos[1] > 0, (accepted, drafted, per_pos)
    if case == "aligned_prefix_cache":
        assert tokens(llm, ps) == reference  # every prompt now starts from cached pages
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
        llm.engine.check_invariants()
    if case == "aligned_preempting":  # a preempted request's draft starts over from position 0
        assert stats["num_preemptions"] > 0 and llm.engine.speculator.proposer.num_restarts > 0
    print(f"{case}: {accepted}/{drafted} drafts accepted")


def test_forks_and_sampling(models, reference):
    llm = LLM(
        str(models["target"]), device="cpu", dtype="float32", kv_cache_tokens=2048, page_size=4,
        speculative_algorithm="eagle3", speculative_cost_gate=False, speculative_draft_model=str(models["aligned"]),
    )  # fmt: skip
    proposer = llm.engine.speculator.proposer
    seen = []
    propose = proposer.propose

    def spy(reqs, budgets):
        drafts = propose(reqs, budgets)
        seen.extend((r.params.greedy, d) for r, d in zip(reqs, drafts))
        return drafts

    proposer.propose = spy
    ps = prompts()
    # n = 2 greedy samples fork after the prompt (a partial page copied): both equal the reference
    outs = llm.generate(ps[:2], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, n=2), use_tqdm=False)
    for out, ref in zip(outs, reference[:2]):
        assert [c.token_ids for c in out.outputs] == ref * 2
    sampled = llm.generate(
        ps, SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=16, ignore_eos=True, seed=1), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 16 for o in sampled)
    llm.engine.check_invariants()
    ids = llm.engine.speculator.proposer.draft.draft_to_target
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    drawn = [d for greedy, d in seen if not greedy and d.tokens]
    assert drawn and all(d.probs is None for greedy, d in seen if greedy)
    for d in drawn:  # the draft's distribution on the target vocabulary, each token drawn from it
        assert d.probs.shape == (len(d.tokens), VOCAB)
        torch.testing.assert_close(d.probs.sum(-1), torch.ones(len(d.tokens)))
        assert float(d.probs[:, outside].abs().max()) == 0
        assert all(float(d.probs[j, t]) > 0 for j, t in enumerate(d.tokens))


def test_sampled_drafts_follow_their_distribution(models):
    """A sampling request's draft token is drawn from the distribution it reports: the draft's
    logits at the request's temperature and top-k, on the target vocabulary."""
    llm = LLM(
        str(models["target"]), device="cpu", dtype="float32", kv_cache_tokens=512,
        speculative_algorithm="eagle3", speculative_cost_gate=False, speculative_draft_model=str(models["aligned"]),
    )  # fmt: skip
    eng = llm.engine
    proposer = eng.speculator.proposer
    params = SamplingParams(temperature=0.3, top_k=4, max_tokens=8, ignore_eos=True, seed=5)
    eng.add_request("s", [5, 9, 5, 9, 5, 9], params, stream=False)
    req = eng.scheduler.waiting[0]
    eng.step()  # the prompt, and the first token
    assert req.num_computed == 6 and len(req.token_ids) == 7
    assert eng.scheduler.reserve_lookahead(req, 1) == 1
    draws = 600
    counts = torch.zeros(VOCAB)
    q = None
    for _ in range(draws):  # each call recomputes the last position: the same distribution, a new draw
        draft = proposer.propose([req], [1])[0]
        counts[draft.tokens[0]] += 1
        if q is None:
            q = draft.probs[0]
        torch.testing.assert_close(draft.probs[0], q)
    assert int((q > 0).sum()) == 4  # top-k
    assert 0.5 * float((counts / draws - q).abs().sum()) < 0.08  # total variation, 600 draws of 4 outcomes
    eng.abort_request("s")
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_invariants()
