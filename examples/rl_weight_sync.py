"""Reinforcement-learning weight sync: a trainer group and a sampler group, each its own
``jax.distributed`` cluster on this host, alternate training and generation through a
weight store.

* Trainer: ``--trainer-processes`` processes x 2 simulated CPU devices, the params FSDP
  (rows) over all of them. Each step it publishes its params as version ``step``
  (``WeightPublisher``: only the snapshot blocks the step), waits for the sampler's
  rollouts of that version, checks them against a greedy generation with its own params,
  and takes a REINFORCE step on them (donating the old params).
* Sampler: 1 process x 2 devices, tensor-parallel (columns / rows over 2). Each step it
  pulls version ``step`` in its own layout (``WeightPuller``; the plan is built once),
  generates greedily from fixed prompts, and writes the rollouts.

The JSON report says, per step, whether the sampler's tokens equal the trainer's own, the
largest logit difference (the two layouts sum in other orders), whether the pulled
params hash equal to the trainer's, and the publish and pull costs.

    python examples/rl_weight_sync.py --steps 4 --json rl.json
    python examples/rl_weight_sync.py --mooncake   # through a Mooncake Store of its own

The store is a directory in ``/dev/shm`` unless ``--store mooncake://host:port?...`` (a
running master) or ``--mooncake`` (a ``mooncake_master`` this script starts) names a
Mooncake Store: each trainer process then keeps its shards in the memory it gives the pool
and the sampler reads its ranges over the transfer engine.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB, D_MODEL, HIDDEN, LAYERS = 256, 128, 256, 2
BATCH, PROMPT, NEW_TOKENS = 4, 8, 8


def init_host_params(seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)

    def dense(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

    return {
        "embed": dense(VOCAB, D_MODEL) * 4,
        "layers": [
            {"w_in": dense(D_MODEL, HIDDEN), "w_out": dense(HIDDEN, D_MODEL)} for _ in range(LAYERS)
        ],
        "norm": np.ones((D_MODEL,), np.float32),
        "unembed": dense(D_MODEL, VOCAB),
    }


def trainer_specs(params):
    """FSDP: every matrix's rows over "fsdp"; the norm too."""
    import jax
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(lambda x: P("fsdp"), params)


def sampler_specs(params):
    """Tensor parallel: embed, w_in, unembed by columns; w_out by rows; the norm replicated."""
    from jax.sharding import PartitionSpec as P

    return {
        "embed": P(None, "tp"),
        "layers": [{"w_in": P(None, "tp"), "w_out": P("tp", None)} for _ in params["layers"]],
        "norm": P(),
        "unembed": P(None, "tp"),
    }


def next_logits(params, tokens):
    """Logits of the next token: [batch, vocab] from tokens int32[batch, length]."""
    import jax

    e = params["embed"][tokens]  # [batch, length, d_model]
    h = e[:, -1] + e.mean(axis=1)
    for layer in params["layers"]:
        h = h + jax.nn.gelu(h @ layer["w_in"]) @ layer["w_out"]
    return (h * params["norm"]) @ params["unembed"]


def generate(params, prompts):
    """Greedy tokens int32[batch, NEW_TOKENS] and their logits [batch, NEW_TOKENS, vocab]."""
    import jax.numpy as jnp

    tokens, out, logits = prompts, [], []
    for _ in range(NEW_TOKENS):
        step = next_logits(params, tokens)
        nxt = jnp.argmax(step, axis=-1).astype(jnp.int32)
        tokens = jnp.concatenate([tokens, nxt[:, None]], axis=1)
        out.append(nxt)
        logits.append(step)
    return jnp.stack(out, axis=1), jnp.stack(logits, axis=1)


def reinforce_loss(params, sequences, advantages):
    """-advantage x log-probability of each sampled continuation (sequences: prompt + new)."""
    import jax
    import jax.numpy as jnp

    total = 0.0
    for i in range(NEW_TOKENS):
        logp = jax.nn.log_softmax(next_logits(params, sequences[:, : PROMPT + i]))
        chosen = jnp.take_along_axis(logp, sequences[:, PROMPT + i, None], axis=1)[:, 0]
        total = total + chosen
    return -jnp.mean(advantages * total)


def prompts_for(step: int):
    import numpy as np

    return np.random.default_rng(1000 + step).integers(0, VOCAB, (BATCH, PROMPT), dtype=np.int32)


def params_hash(leaves) -> str:
    h = hashlib.blake2b(digest_size=16)
    for x in leaves:
        h.update(x.tobytes())
    return h.hexdigest()


def write_json_atomic(path: Path, doc) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def wait_for(path: Path, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.01)
    return json.loads(path.read_text())


def run_trainer(args) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_tpusync.weights.sync import WeightPublisher

    mesh = jax.make_mesh(
        (jax.device_count(),),
        ("fsdp",),
        devices=jax.devices(),
        axis_types=(jax.sharding.AxisType.Auto,),
    )
    host = init_host_params()
    specs = trainer_specs(host)
    params = jax.tree.map(
        lambda x, s: jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, s), lambda i, x=x: x[i]
        ),
        host,
        specs,
    )
    replicated = NamedSharding(mesh, P())

    def global_replicated(x):
        return jax.make_array_from_callback(x.shape, replicated, lambda i: x[i])

    generate_jit = jax.jit(generate, out_shardings=(replicated, replicated))

    def train_step(params, sequences, advantages):
        loss, grads = jax.value_and_grad(reinforce_loss)(params, sequences, advantages)
        return jax.tree.map(lambda p, g: p - args.lr * g, params, grads), loss

    # The old params are donated: publish() snapshotted them, so that is safe.
    train_step_donating = jax.jit(train_step, donate_argnums=0)
    directory = Path(args.dir)
    store = f"{args.store}&segment_mb=64" if args.store else directory / "weights"
    publisher = WeightPublisher(store, keep=2)
    steps = []
    for step in range(args.steps):
        start = time.perf_counter()
        publisher.publish(params, step)
        blocked = time.perf_counter() - start
        rollouts = wait_for(directory / f"rollouts-{step:04d}.json", args.timeout)
        prompts = prompts_for(step)
        own_tokens, own_logits = generate_jit(params, global_replicated(prompts))
        own_tokens = np.asarray(own_tokens.addressable_data(0))
        own_logits = np.asarray(own_logits.addressable_data(0))
        gathered = [
            multihost_utils.process_allgather(x, tiled=True) for x in jax.tree.leaves(params)
        ]
        sampled = np.asarray(rollouts["tokens"], np.int32)
        rewards = (sampled < VOCAB // 2).mean(axis=1).astype(np.float32)  # Low tokens pay.
        sequences = np.concatenate([prompts, sampled], axis=1)
        params, loss = train_step_donating(
            params, global_replicated(sequences), global_replicated(rewards - rewards.mean())
        )
        publish_stats = publisher.wait()  # Done long ago (it overlapped the step).
        steps.append(
            {
                "version": step,
                "tokens_equal": bool(np.array_equal(own_tokens, sampled)),
                "max_logit_diff": float(
                    np.max(np.abs(own_logits - np.asarray(rollouts["logits"])))
                ),
                "params_hash_equal": params_hash(gathered) == rollouts["params_hash"],
                "mean_reward": float(rewards.mean()),
                "loss": float(np.asarray(loss.addressable_data(0))),
                "publish_blocked_s": blocked,
                "publish_write_s": publish_stats.write_seconds,
                "published_bytes": publish_stats.nbytes,
                **{
                    k: rollouts[k]
                    for k in ("pull_s", "pull_wait_s", "pull_copy_s", "bytes_read", "plan_cached")
                },
            }
        )
    publisher.close()
    if jax.process_index() == 0:
        write_json_atomic(directory / "trainer.json", {"steps": steps})


def run_sampler(args) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    from jax_tpusync.weights.sync import WeightPuller

    mesh = jax.make_mesh(
        (jax.device_count(),),
        ("tp",),
        devices=jax.devices(),
        axis_types=(jax.sharding.AxisType.Auto,),
    )
    targets = jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        sampler_specs(init_host_params()),
        is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec),
    )
    generate_jit = jax.jit(generate)
    directory = Path(args.dir)
    store = f"{args.store}&segment_mb=0" if args.store else directory / "weights"
    puller = WeightPuller(store, timeout_s=args.timeout)
    for step in range(args.steps):
        start = time.perf_counter()
        params = puller.pull(targets, step)
        pull_s = time.perf_counter() - start
        tokens, logits = generate_jit(params, prompts_for(step))
        write_json_atomic(
            directory / f"rollouts-{step:04d}.json",
            {
                "tokens": np.asarray(tokens).tolist(),
                "logits": np.asarray(logits).tolist(),
                "params_hash": params_hash([np.asarray(x) for x in jax.tree.leaves(params)]),
                "pull_s": pull_s,
                "pull_wait_s": puller.stats.wait_seconds,
                "pull_copy_s": puller.stats.read_seconds + puller.stats.put_seconds,
                "bytes_read": puller.stats.bytes_read,
                "plan_cached": puller.stats.plan_cached,
            },
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def spawn_group(role: str, processes: int, devices: int, args) -> list[subprocess.Popen]:
    port = free_port()
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    return [
        subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--role",
                role,
                "--process",
                str(i),
                "--processes",
                str(processes),
                "--port",
                str(port),
                "--dir",
                args.dir,
                "--steps",
                str(args.steps),
                "--lr",
                str(args.lr),
                "--timeout",
                str(args.timeout),
                *(["--store", args.store] if args.store else []),
            ],
            env=env,
        )
        for i in range(processes)
    ]


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--trainer-processes", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument(
        "--store",
        default=None,
        metavar="mooncake://HOST:PORT",
        help="a Mooncake Store for the weights (its master running); default: /dev/shm",
    )
    p.add_argument(
        "--mooncake", action="store_true", help="start a mooncake_master and use it as --store"
    )
    # Internal: one process of a group.
    p.add_argument("--role", choices=("trainer", "sampler"), help=argparse.SUPPRESS)
    p.add_argument("--process", type=int, help=argparse.SUPPRESS)
    p.add_argument("--processes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        import jax

        jax.distributed.initialize(f"localhost:{args.port}", args.processes, args.process)
        (run_trainer if args.role == "trainer" else run_sampler)(args)
        jax.distributed.shutdown()
        return None
    if args.steps < 1 or args.trainer_processes < 1:
        p.error("--steps and --trainer-processes must be >= 1")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with contextlib.ExitStack() as stack:
        if args.mooncake and not args.store:
            from jax_tpusync.bench.mooncake_master import LocalMaster

            args.store = f"mooncake://{stack.enter_context(LocalMaster()).address}"
        if args.store:  # One namespace per run; options follow it.
            sep = "&" if "?" in args.store else "?"
            args.store = f"{args.store}{sep}namespace=rl-{os.getpid()}"
        return run_groups(args, base)


def run_groups(args, base: str | None) -> dict:
    """Runs the trainer and the sampler group to the end; the report."""
    with tempfile.TemporaryDirectory(prefix="rl-weight-sync-", dir=base) as d:
        args.dir = d
        start = time.perf_counter()
        procs = spawn_group("trainer", args.trainer_processes, 2, args)
        procs += spawn_group("sampler", 1, 2, args)
        deadline = time.monotonic() + args.timeout * (args.steps + 2)
        try:
            # One failed process fails the run at once (its peers would wait for it).
            while any(proc.poll() is None for proc in procs):
                codes = [proc.returncode for proc in procs]
                if any(codes) or time.monotonic() > deadline:
                    raise SystemExit(f"a process failed or the run timed out (exit codes {codes})")
                time.sleep(0.05)
        finally:
            for proc in procs:
                proc.kill()
        codes = [proc.returncode for proc in procs]
        if any(codes):
            raise SystemExit(f"a process failed (exit codes {codes})")
        steps = json.loads((Path(d) / "trainer.json").read_text())["steps"]
    doc = {
        "trainer": {
            "processes": args.trainer_processes,
            "mesh": f"fsdp={2 * args.trainer_processes}",
        },
        "sampler": {"processes": 1, "mesh": "tp=2"},
        "steps": steps,
        "all_match": all(s["tokens_equal"] and s["params_hash_equal"] for s in steps),
        "seconds": time.perf_counter() - start,
    }
    for s in steps:
        print(
            f"version {s['version']}: tokens equal {s['tokens_equal']}, params equal "
            f"{s['params_hash_equal']}, max logit diff {s['max_logit_diff']:.2e}, reward "
            f"{s['mean_reward']:.2f}, publish blocked {s['publish_blocked_s'] * 1e3:.1f} ms, "
            f"pull {s['pull_copy_s'] * 1e3:.1f} ms after waiting {s['pull_wait_s']:.1f} s for "
            f"the version ({s['bytes_read']} B, plan cached {s['plan_cached']})"
        )
    print(f"all match: {doc['all_match']} ({doc['seconds']:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
