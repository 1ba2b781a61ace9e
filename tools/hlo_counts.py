"""XLA's cost analysis and op counts of a compiled program, for both sides of ``python -m tools.vs_blog``.

Pure Python (no JAX import): tools/blog_pipeline.py runs it on the blog's stack, tools/vs_blog.py on the engine's.
"""

from __future__ import annotations

import re

# HLO instructions counted by :func:`hlo_ops` in the optimized module (one line each in its text).
HLO_OPS = ("transpose", "copy", "convert", "all-gather", "all-reduce", "all-to-all", "collective-permute",
           "custom-call", "dot", "convolution", "while", "conditional", "fusion", "reduce", "broadcast",
           "concatenate", "exponential", "divide", "send", "recv", "infeed", "outfeed")


def hlo_opcode(line: str) -> str | None:
    """The opcode of one HLO instruction line (``%name = SHAPE opcode(operands), ...``), or None."""
    head, sep, rest = line.partition(" = ")
    if not sep or not head.strip() or " " in head.strip().removeprefix("ROOT "):
        return None
    rest = rest.lstrip()
    if rest.startswith("("):  # a tuple shape: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.partition(" ")[2]
    match = re.match(r"\s*([\w-]+)\(", rest)
    return match[1] if match else None


def hlo_ops(text: str) -> dict:
    """How many instructions of each of :data:`HLO_OPS` an HLO module's text holds (fused computations included),
    and its host callbacks (custom-calls whose target names a Python callback)."""
    counts = dict.fromkeys(HLO_OPS, 0)
    for line in text.splitlines():
        op = hlo_opcode(line)
        if op in counts:
            counts[op] += 1
    counts["host_callbacks"] = len(re.findall(r"custom_call_target=\"[^\"]*callback[^\"]*\"", text))
    return counts


def computations(text: str) -> dict[str, list[str]]:
    """An HLO module's text split into its computations: name -> instruction lines."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if match and line.rstrip().endswith("{"):
            current = match[1]
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


def loop_body_ops(text: str) -> dict:
    """Op counts of the denoising loop's body: the body of the largest ``while`` (by instructions) in the module,
    counted at its top level (its fusions count once each; calls and conditionals are listed by what they hold)."""
    comps = computations(text)
    bodies = [match[1] for lines in comps.values() for line in lines if " while(" in line
              for match in [re.search(r"body=%([\w.\-]+)", line)] if match]
    if not bodies:
        return {}
    body = max(bodies, key=lambda name: len(comps.get(name, ())))
    counts: dict[str, int] = {}
    for line in comps[body]:
        op = hlo_opcode(line)
        if op and op not in ("get-tuple-element", "parameter", "tuple", "constant", "bitcast"):
            counts[op] = counts.get(op, 0) + 1
    nested = sum(" while(" in line for name in comps for line in comps[name]
                 if name != body and any(f"to_apply=%{name}" in b or f"body=%{name}" in b for b in comps[body]))
    return {"ops": dict(sorted(counts.items(), key=lambda kv: -kv[1])), "instructions": len(comps[body]),
            "nested_while_loops": nested}


def cost_of(compiled) -> dict:
    """XLA's cost analysis of a compiled program: flops, bytes accessed, transcendentals (0 where not reported)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "transcendentals": float(cost.get("transcendentals", 0.0))}


def program_counts(compiled) -> dict:
    """:func:`cost_of`, :func:`hlo_ops` and :func:`loop_body_ops` of one compiled program."""
    text = compiled.as_text()
    return {**cost_of(compiled), "ops": hlo_ops(text), "loop_body": loop_body_ops(text)}
