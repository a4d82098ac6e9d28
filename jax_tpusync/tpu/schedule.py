"""Whether each unit copy of a compiled host-pool step overlaps an attention, read off the
scheduled program (``compiled.as_text()``).

The host-pool step names its unit copies and its attention with JAX name scopes
(:data:`jax_tpusync.step.host_pool.FETCH_SCOPE`, :data:`~jax_tpusync.step.host_pool.ATTEND_SCOPE`),
which the compiler keeps in each instruction's metadata; a copy is an asynchronous
``*-start`` / ``*-done`` pair. A loop iteration is one computation: it attends to one unit
while it copies the next.
"""

from __future__ import annotations

import re

__all__ = ["schedule_overlap"]

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*.*?\b([a-z][a-z0-9-]*)\(")


def schedule_overlap(hlo_text: str, fetch_scope: str, attend_scope: str) -> dict:
    """Whether each unit copy of the scheduled program overlaps an attention.

    In every computation (a loop body is one unit: the copy of the next unit and the
    attention of this one) that holds both, every copy of the fetch scope must start before
    the computation's first attention instruction and be waited for after its last one.
    Returns counts: computations checked, copies, copies started before the attention, and
    copies that also end after it (the compiler may wait for one of a unit's copies before
    the attention begins, once the work between its start and the attention is done).
    """
    checked = copies = started_before = overlapped = 0
    for body in re.split(r"\n(?=\S)", hlo_text):
        starts: dict[str, int] = {}
        dones: dict[str, int] = {}
        attend_at: list[int] = []
        for index, line in enumerate(body.splitlines()):
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            name, opcode = match.groups()
            if opcode.endswith("-start") and fetch_scope in line:
                starts[name] = index
            elif opcode.endswith("-done"):
                operand = re.search(r"-done\(%(\S+?)\)", line)
                if operand and operand.group(1) in starts:
                    dones[operand.group(1)] = index
            elif attend_scope in line and opcode in ("fusion", "custom-call", "dot", "convolution"):
                attend_at.append(index)
        if not starts or not attend_at:
            continue
        checked += 1
        for name, start in starts.items():
            copies += 1
            done = dones.get(name, -1)
            started_before += start < min(attend_at)
            overlapped += start < min(attend_at) and done > max(attend_at)
    return dict(
        computations=checked, copies=copies, started_before=started_before, overlapped=overlapped
    )
