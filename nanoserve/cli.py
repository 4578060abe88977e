"""Command line: `nanoserve generate`, plus `serve` and `chat` from the server package and
`bench` from nanoserve.bench.

Owns: argument parsing and the `generate` command (offline generation for a few prompts).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from nanoserve.config import add_engine_args, engine_config_from_args
from nanoserve.models.registry import DEFAULT_MODEL
from nanoserve.sampling_params import SamplingParams

EXAMPLE_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
]


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from nanoserve.llm import LLM

    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        prompts = EXAMPLE_PROMPTS
    params = sampling_from_args(args)
    config = engine_config_from_args(args)
    if config.node_rank > 0:  # multi-host tensor parallelism: this host runs worker ranks only
        from nanoserve.distributed.tp_runner import run_worker_node
        from nanoserve.engine.llm_engine import serve_worker_rank

        return run_worker_node(config, serve_worker_rank)
    llm = LLM(config=config)
    use_chat = not args.raw and llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None)
    if use_chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "outputs": [o.text for o in out.outputs]}))
            continue
        print(f"### {prompt}")
        for o in out.outputs:
            print(o.text.strip())
            print(f"[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}]")
        print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="A compact LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate answers to prompts offline")
    gen.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model alias, GGUF file or HF directory (default {DEFAULT_MODEL})"
    )
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    try:
        from nanoserve.server.commands import register
    except ImportError:
        register = None
    if register is not None:
        register(sub)
    from nanoserve.bench import register as register_bench

    register_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve --dp` hands it to its replicas
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
