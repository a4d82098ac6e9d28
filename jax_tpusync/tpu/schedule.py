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

_ATTENTION_OPCODES = ("fusion", "custom-call", "dot", "convolution")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*.*?\b([a-z][a-z0-9-]*)\(")


def schedule_overlap(
    hlo_text: str,
    fetch_scope: str | tuple[str, ...],
    attend_scope: str | tuple[str, ...],
    *,
    loops: bool = False,
) -> dict:
    """Whether each unit copy of the scheduled program overlaps an attention.

    In every computation (a loop body is one unit: the copy of the next unit and the
    attention of this one) that holds both, every copy of the fetch scope must start before
    the computation's first attention instruction and be waited for after its last one.
    Returns counts: computations checked, copies, copies started before the attention,
    copies that also end after it (the compiler may wait for one of a unit's copies before
    the attention begins, once the work between its start and the attention is done), and
    ``spanning``: copies with an attention instruction between their start and their end
    (in any computation: also a copy outside a loop, whose computation holds other layers'
    attention).

    Args:
      hlo_text: the scheduled program, ``compiled.as_text()``.
      fetch_scope: text a copy's ``*-start`` line holds (its name scope, or its shape where
        the compiler drops the scope), or several texts it holds every one of (a copy's
        shape and its source's: a device-side slice of a copied chunk has the chunk's
        shape too, but not the host array's).
      attend_scope: one scope an attention instruction's line holds, or several.
      loops: a loop (``while``: a layer's unit walk, or its scoring) counts as an
        attention too.
    """
    scopes = (attend_scope,) if isinstance(attend_scope, str) else tuple(attend_scope)
    fetch_texts = (fetch_scope,) if isinstance(fetch_scope, str) else tuple(fetch_scope)
    checked = copies = started_before = overlapped = spanning = 0
    for body in re.split(r"\n(?=\S)", hlo_text):
        starts: dict[str, int] = {}
        dones: dict[str, int] = {}
        attend_at: list[int] = []
        for index, line in enumerate(body.splitlines()):
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            name, opcode = match.groups()
            if opcode.endswith("-start") and all(text in line for text in fetch_texts):
                starts[name] = index
            elif opcode.endswith("-done"):
                operand = re.search(r"-done\(%(\S+?)\)", line)
                if operand and operand.group(1) in starts:
                    dones[operand.group(1)] = index
            elif any(scope in line for scope in scopes) and opcode in _ATTENTION_OPCODES:
                attend_at.append(index)
            elif loops and opcode == "while":
                attend_at.append(index)
        if not starts or not attend_at:
            continue
        checked += 1
        for name, start in starts.items():
            copies += 1
            done = dones.get(name, -1)
            started_before += start < min(attend_at)
            overlapped += start < min(attend_at) and done > max(attend_at)
            spanning += any(start < at < done for at in attend_at)
    return dict(
        computations=checked,
        copies=copies,
        started_before=started_before,
        overlapped=overlapped,
        spanning=spanning,
    )
