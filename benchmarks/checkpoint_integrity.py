"""What checkpoint checksums cost: save and restore of a real-size train state, plain
orbax (what `arl.runs.checkpoint.Checkpointer` did before) against the checksummed
`Checkpointer`, interleaved in one process.

A record of one decision (checksum every checkpointed array; benchmarks/RESULTS.md,
"Checkpoint checksums"), kept to measure that cost on other hardware.

The state is the weights of `configs/real_sizes.py` at `--shape`: its bfloat16
parameters and a float32 master copy (Qwen2.5-0.5B: 0.92 + 1.84 GiB), random normals
on a `--mesh` of fake CPU devices, sharded as a run shards them. (The whole train state
adds Adam's two moments, 6.4 GiB in all: building, saving and restoring it beside itself
needs more than this machine's 23 GiB; checksum and write times scale with the bytes.)
"before" saves and restores it with orbax's `CheckpointManager` exactly as
the Checkpointer does (StandardSave / StandardRestore of the state, JSON metadata,
waiting for the commit); "after" is the Checkpointer, which adds a checksum pass over
every array at save and at restore (`arl.runs.checksums`) and the non-finite check that
comes with it. Rounds alternate the order (A B, B A, ...); each side writes a new step
of its own directory (max_to_keep=1, so the disk holds one state per side). The first
checksum call compiles; its time is reported apart.

    python benchmarks/checkpoint_integrity.py [--shape qwen2.5-0.5b] [--mesh 1,8,1]
        [--rounds 3] [--dir /tmp] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position

if __name__ == "__main__":
    common.force_host_devices(["--devices", "8"])

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import real_sizes  # noqa: E402  pylint: disable=wrong-import-position

from arl.runs import checkpoint, checksums  # noqa: E402

SECTION = "Checkpoint checksums"
NOTE = (
    "\nThe added time is the checksum pass, once at save and once at restore: on the CPU "
    "it is compute-bound (one MurmurHash3 finaliser per 32-bit word, the index computed "
    "alongside), comparable to the time orbax takes to write the same bytes to a local "
    "disk; on a GPU or TPU it is one fused read of the state (not measured here). Absolute "
    "times "
    "are from a shared machine (load average in the heading), so compare the two sides, "
    "which ran interleaved.\n")


class PlainOrbax:
    """The Checkpointer's orbax calls without its checksums (the "before" side)."""

    def __init__(self, directory):
        self.manager = ocp.CheckpointManager(
            directory, item_handlers={"state": ocp.StandardCheckpointHandler(),
                                      "metadata": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))

    def save(self, step, state, metadata):
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(metadata)),
            force=True)
        self.manager.wait_until_finished()

    def restore(self, step, target):
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), metadata=ocp.args.JsonRestore()))
        return restored["state"]


class Checksummed:
    def __init__(self, directory):
        self.ckpt = checkpoint.Checkpointer(directory, max_to_keep=1)

    def save(self, step, state, metadata):
        self.ckpt.save(step, state, metadata=metadata, force=True)

    def restore(self, step, target):
        return self.ckpt.restore(step, target)[0]


def _block(tree):
    jax.block_until_ready(jax.tree.leaves(tree))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--mesh", default="1,8,1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a temp dir)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    mesh = common.parse_meshes(args.mesh)[0]

    trainer = real_sizes.make_trainer(real_sizes.make_config(args.shape, mesh))
    params = trainer.abstract_state().params
    target = {"params": params, "master": jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, np.float32, sharding=a.sharding), params)}
    leaves, treedef = jax.tree.flatten(target)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    state = jax.tree.unflatten(treedef, [
        jax.jit(lambda key, a=leaf: jax.random.normal(key, a.shape, a.dtype),
                out_shardings=leaf.sharding)(key) for key, leaf in zip(keys, leaves)])
    _block(state)
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state) if hasattr(leaf, "nbytes"))
    metadata = {"config": {"shape": args.shape}}

    start = time.perf_counter()
    checksums.tree_checksums(state)
    first_checksum_s = time.perf_counter() - start
    checksum_s = []

    root = tempfile.mkdtemp(prefix="arl-ckpt-bench-", dir=args.dir)
    sides = {"before (orbax)": PlainOrbax(os.path.join(root, "before")),
             "after (checksums)": Checksummed(os.path.join(root, "after"))}
    times = {name: {"save": [], "restore": []} for name in sides}
    try:
        for round_index in range(args.rounds):
            order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
            for name in order:
                side = sides[name]
                t0 = time.perf_counter()
                side.save(round_index, state, metadata)
                t1 = time.perf_counter()
                restored = side.restore(round_index, target)
                _block(restored)
                t2 = time.perf_counter()
                times[name]["save"].append(t1 - t0)
                times[name]["restore"].append(t2 - t1)
                del restored
            t0 = time.perf_counter()
            checksums.tree_checksums(state)
            checksum_s.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    before, after = med["before (orbax)"], med["after (checksums)"]
    rows = [[name, f"{m['save']:.2f}", f"{m['restore']:.2f}",
             f"{nbytes / 2**30 / m['save']:.2f}", f"{nbytes / 2**30 / m['restore']:.2f}"]
            for name, m in med.items()]
    rows.append(["after / before", f"{after['save'] / before['save']:.2f}x",
                 f"{after['restore'] / before['restore']:.2f}x", "", ""])
    leaves = len(jax.tree.leaves(state))
    text = common.heading("checkpoint_integrity.py") + (
        f"State: the weights of `configs/real_sizes.py` {args.shape}, bfloat16 parameters "
        f"and their float32 master copy (random normals, sharded as the run's) on mesh "
        f"{mesh} (fake CPU devices): {leaves} arrays, "
        f"{nbytes / 2**30:.2f} GiB. Medians of "
        f"{args.rounds} interleaved rounds (order alternating), local disk; restore "
        "includes waiting for the arrays.\n\n"
        + common.markdown_table(["side", "save (s)", "restore (s)", "save GiB/s",
                                 "restore GiB/s"], rows)
        + f"\n\nOne checksum pass over the state (the part added at save and again at "
        f"restore): {statistics.median(checksum_s):.2f} s median "
        f"({nbytes / 2**30 / statistics.median(checksum_s):.2f} GiB/s); its first call, "
        f"compiling the program: {first_checksum_s:.2f} s.\n" + NOTE)
    common.publish(SECTION, text, not args.no_write)


if __name__ == "__main__":
    main()
