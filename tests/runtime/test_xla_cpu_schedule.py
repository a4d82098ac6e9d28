"""jax_tpusync.runtime.xla_cpu: the memory-minimizing CPU schedule is set before JAX starts, kept
when the user chose, refused once the backends run, and changes what XLA's schedule does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from jax_tpusync.runtime import xla_cpu

# Compiles a 4-layer bf16 decoder's projections as one program in a fresh process and
# prints, in schedule order, the positions of the last layer's weight conversions and of
# the first layer's first dot.
_PROBE = r"""
import json, sys
from jax_tpusync.runtime import xla_cpu
if sys.argv[1] == "memory":
    assert xla_cpu.use_memory_scheduler() == "set"
import jax, jax.numpy as jnp
L, D = 4, 256
W = [tuple(jnp.zeros(s, jnp.bfloat16) for s in [(D, D), (D, D)]) for _ in range(L)]
def step(x, W):
    for wq, wo in W:
        x = x + (x @ wq) @ wo
    return x
text = jax.jit(step).lower(jnp.zeros((1, D), jnp.bfloat16), W).compile().as_text()
entry = text[text.index("ENTRY"):].splitlines()[1:]
last = f"W_{L - 1}__0_"
convert = min(i for i, l in enumerate(entry) if "convert" in l and last in l)
dot = min(i for i, l in enumerate(entry) if " dot(" in l)
print(json.dumps({"last_layer_convert": convert, "first_dot": dot}))
"""


def _schedule(mode: str) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",  # Not the repository root, whose source package has no built extension.
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_memory_schedule_converts_a_layer_s_weights_after_the_first_layer_ran():
    default = _schedule("default")
    memory = _schedule("memory")
    # XLA's default hoists every layer's conversion before the first dot; the memory
    # schedule leaves the last layer's for when that layer comes.
    assert default["last_layer_convert"] < default["first_dot"], default
    assert memory["last_layer_convert"] > memory["first_dot"], memory


def test_a_flag_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"{xla_cpu.SCHEDULER_FLAG}=true")
    assert xla_cpu.use_memory_scheduler() == "kept"
    assert os.environ["XLA_FLAGS"] == f"{xla_cpu.SCHEDULER_FLAG}=true"


def test_once_the_backends_run_the_call_is_refused_by_name(monkeypatch):
    jax.devices()  # This process computes already.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    with pytest.raises(
        RuntimeError, match=r"tpusync: use_memory_scheduler\(\) must run before JAX"
    ):
        xla_cpu.use_memory_scheduler()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


def test_a_jaxlib_without_the_flag_is_left_alone(monkeypatch):
    assert xla_cpu._jaxlib_knows(xla_cpu.SCHEDULER_FLAG)
    assert not xla_cpu._jaxlib_knows("--xla_cpu_tpusync_no_such_flag")
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(xla_cpu, "_backends_started", lambda: False)
    monkeypatch.setattr(xla_cpu, "_jaxlib_knows", lambda flag: False)
    assert xla_cpu.use_memory_scheduler() == "unknown"
    assert os.environ["XLA_FLAGS"] == ""


def test_setup_cpu_sets_the_schedule_and_keeps_a_cpu_for_the_engine():
    """The one setup call: the schedule flag set and an EngineConfig with the engine's CPUs
    (none kept where the process has a single CPU); refused once JAX runs."""
    script = textwrap.dedent(
        """
        import os
        import jax_tpusync as tps
        config = tps.setup_cpu()
        assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in os.environ["XLA_FLAGS"]
        allowed = len(os.sched_getaffinity(0)) + len(config.worker_cpus)
        assert len(config.worker_cpus) == (1 if allowed > 1 else 0), config
        import jax
        jax.devices()
        try:
            tps.setup_cpu()
        except RuntimeError as e:
            print(e)
        """
    )
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
        cwd="/",  # Not the source tree, whose package has no built extension.
    )
    assert proc.returncode == 0, proc.stderr
    assert "setup_cpu() must run before JAX starts its backends" in proc.stdout
