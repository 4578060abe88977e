"""EAGLE-3 on the GPU (run on a GPU with `pytest -m gpu tests/test_gpu_eagle3.py`): the tiny
target and accepting draft of tests/test_speculative_eagle3.py in fp32 on CUDA. Greedy tokens
with speculation equal speculation off, with CUDA graphs (decode and piecewise) and the
overlap loop on and with everything eager; the feature cache written by decode-graph replays
and piecewise-graph prefills holds Hugging Face's hidden states."""

from __future__ import annotations

import pytest
import torch

from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams
from tests.test_speculative_eagle3 import models, prompts, tokens  # noqa: F401 -- models: a fixture
from tests.tiny import VOCAB

pytestmark = pytest.mark.gpu


def make(models, eagle3: bool, **kw) -> LLM:  # noqa: F811 -- the fixture's value
    spec = {"speculative_algorithm": "eagle3", "speculative_draft_model": str(models["aligned"])} if eagle3 else {}
    return LLM(str(models["target"]), dtype="float32", kv_cache_tokens=4096, max_num_seqs=16, **spec, **kw)


def count_replays(llm: LLM) -> dict[str, int]:
    """Counts decode-graph replays of `llm` from now on (the piecewise graphs count their own)."""
    counts = {"decode": 0}
    graphs = llm.engine.runner.graphs
    replay = graphs.replay

    def counted(inputs):
        counts["decode"] += 1
        return replay(inputs)

    graphs.replay = counted
    return counts


@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_greedy_identical_on_gpu(models, mode):  # noqa: F811
    kw = {"enforce_eager": True} if mode == "eager" else {}
    ps = prompts()
    reference = tokens(make(models, False, **kw), ps)
    llm = make(models, True, **kw)
    counts = count_replays(llm) if mode == "graphs" else None
    assert tokens(llm, ps) == reference
    assert tokens(llm, ps) == reference  # prefix-cache hits
    llm.engine.check_invariants()
    stats = llm.stats()
    assert stats["vllm:spec_decode_num_accepted_tokens"] > 0
    print(mode, stats["vllm:spec_decode_num_accepted_tokens"], "/", stats["vllm:spec_decode_num_draft_tokens"], counts)
    graphs = llm.engine.speculator.proposer.graphs
    if mode == "graphs":  # back-off steps and the prompt's last token decode through the graphs
        assert counts["decode"] > 0
        assert graphs.num_replays > 0  # and the draft's decode steps through its own
    else:
        assert graphs is None


def test_graphs_write_features(models):  # noqa: F811
    from transformers import AutoModelForCausalLM

    llm = make(models, True, page_size=4)
    eng = llm.engine
    runner = eng.runner
    assert runner.graphs is not None
    counts = count_replays(llm)
    speculator, eng.speculator = eng.speculator, None  # plain decode steps: graph replays
    prompt = [(7 * i + 3) % VOCAB for i in range(29)]
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), stream=False)
    req = eng.scheduler.waiting[0]
    pages = None
    while eng.has_unfinished_requests():
        eng.step()
        pages = req.pages if req.pages else pages  # the list stays ours once released
    seq = list(req.token_ids)
    computed = len(seq) - 1  # the last token is never computed
    assert counts["decode"] > 0
    pos = torch.arange(computed, device=eng.device)
    pages = torch.tensor(pages, device=eng.device)
    slots = pages[pos // 4] * 4 + pos % 4
    features = speculator.proposer.features
    got = features.data[slots].float().cpu()
    hf = AutoModelForCausalLM.from_pretrained(str(models["target"]), dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([seq[:computed]]), output_hidden_states=True).hidden_states
    for j, layer in enumerate(features.layers):
        torch.testing.assert_close(got[:, j], states[layer][0], rtol=2e-3, atol=2e-3)
    eng.speculator = speculator
    eng.check_invariants()
    print("piecewise replays", dict(runner.piecewise.replays) if runner.piecewise else None, counts)


def test_sampled_on_gpu(models):  # noqa: F811
    llm = make(models, True)
    outs = llm.generate(
        prompts(), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=3), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    llm.engine.check_invariants()
    assert llm.stats()["vllm:spec_decode_num_draft_tokens"] > 0
