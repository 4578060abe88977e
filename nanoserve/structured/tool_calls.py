"""The grammar that forces a reply to be tool calls (tool_choice "required" or a named function).

Owns `tool_call_constraint`: an EBNF grammar (StructuredOutputs.grammar) that admits
`begin {"<name_key>": "<function name>", "<args_key>": <JSON of that function's parameters
schema>} end`, optionally repeated with whitespace (or a separator) between calls, and nothing
else; at most MAX_SPACE whitespace characters at each place they may go. The JSON part comes from xgrammar's own JSON Schema converter (one schema: anyOf over
the functions, each pinning its name with `const`), so arguments follow the same rules as
response_format.
"""

from __future__ import annotations

import json

import xgrammar as xgr

from nanoserve.sampling_params import StructuredOutputs

_CALL_RULE = "nanoserve_tool_call"
# Whitespace around and between calls is bounded: a weak model's greedy reply, free to add
# spaces there, otherwise spins in them until max_tokens and never closes its call.
MAX_SPACE = 4


def _rename_root(ebnf: str, new: str) -> str:
    """Rename the rule `root` (definition and references) to `new`, leaving string literals
    and character classes alone (a property named "root" appears inside literals)."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c in '"[':  # copy a literal or a class verbatim, honouring backslash escapes
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i : j + 1])
            i = j + 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (ebnf[j].isalnum() or ebnf[j] in "_-"):
                j += 1
            word = ebnf[i:j]
            out.append(new if word == "root" else word)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def tool_call_constraint(
    begin: str,
    end: str,
    functions: list[dict],
    *,
    at_least_one: bool,
    allow_many: bool,
    name_key: str = "name",
    args_key: str = "arguments",
    separator: str = "",
    prefix: str = "",
    suffix: str = "",
) -> StructuredOutputs:
    """`functions`: OpenAI function objects ({"name", "parameters"?, ...}); a function without
    `parameters` takes any JSON object. `at_least_one` False also admits an empty reply.
    Calls are separated by whitespace, around `separator` when one is given (e.g. ";");
    `prefix` and `suffix` enclose all of them (mistral's list: "[" and "]")."""
    if not functions:
        raise ValueError("tool_call_constraint needs at least one function")
    cases = []
    for fn in functions:
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"every function needs a non-empty string name, got {fn!r}")
        params = fn.get("parameters") or {"type": "object"}
        cases.append(
            {
                "type": "object",
                "properties": {name_key: {"const": name}, args_key: params},
                "required": [name_key, args_key],
                "additionalProperties": False,
            }
        )
    schema = cases[0] if len(cases) == 1 else {"anyOf": cases}
    try:
        call = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"invalid parameters schema in tools: {str(exc).strip()}") from None
    ws = f"[ \\t\\n]{{0,{MAX_SPACE}}}"
    block = f"{json.dumps(begin)} {ws} {_CALL_RULE} {ws} {json.dumps(end)}"
    between = f"{ws} {json.dumps(separator)} {ws}" if separator else ws
    calls = f"({block})" + (f" ({between} {block})*" if allow_many else "")
    if prefix or suffix:
        calls = f"{json.dumps(prefix)} {ws} {calls} {ws} {json.dumps(suffix)}"
    root = f"root ::= {calls}" if at_least_one else f'root ::= "" | {calls}'
    return StructuredOutputs(grammar=root + "\n" + _rename_root(call, _CALL_RULE))
