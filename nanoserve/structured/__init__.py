"""Structured outputs: grammars that constrain what a request may generate.

Owns: compiling a `StructuredOutputs` (JSON Schema, JSON object, regex, choice, EBNF) into an
xgrammar grammar off the step loop, with a cache and a time limit (`compiler`); the
per-sample grammar state that accepts tokens and fills next-token bitmasks (`matcher`); the
grammar that forces tool calls (`tool_calls`).

The engine applies a constrained row's bitmask in the sampler, on the device; requests
without a constraint never touch this package.
"""

from nanoserve.sampling_params import StructuredOutputs
from nanoserve.structured.compiler import GrammarError, GrammarService, PendingGrammar
from nanoserve.structured.matcher import GrammarMatcher, bitmask_words, live_matchers
from nanoserve.structured.tool_calls import tool_call_constraint

__all__ = [
    "GrammarError",
    "GrammarMatcher",
    "GrammarService",
    "PendingGrammar",
    "StructuredOutputs",
    "bitmask_words",
    "live_matchers",
    "tool_call_constraint",
]
