"""The race: arl's GRPO step against TRL's GRPOTrainer and tunix's GRPOLearner, at equal work.

The equal work, arl's side (`harness.ArlRunner`: its default configuration, built as a
notebook builds it) and the FLOP formulas are in `harness.py`. Settings
(`peer_workers/protocol.py`): toy, modest, multiturn (guess_number, 6 turns: arl plays
every turn inside its one compiled step; the peers pay a host round trip and a
`generate` call per turn: TRL through its `rollout_func`, one call per turn over the
unfinished episodes; tunix through its agentic learner, one call per episode per turn),
tiny (the smoke test's size).

Each peer runs in its own virtual environment under `--cache_dir` (created on first use
with `python -m venv` and pip: `torch==2.13.0` + `trl`, or `google-tunix`), as a worker
process (`peer_workers/*_worker.py`) that builds its trainer, warms up, then runs one
training step per "step" line on stdin and answers with its timings as a JSON line. All
workers stay alive, so rounds are INTERLEAVED (arl, trl, tunix, arl, ...) and load from
other jobs on this shared machine hits every side alike. A peer that cannot be installed
or crashes is reported in one line and the others carry on. The peers time their own
generation (TRL: `GRPOTrainer._generate`; tunix: `RLCluster.generate`).

arl's side runs in this process after `arl.setup()`, as a notebook's first cell calls it
(the library's CPU host settings, `arl.runs.process_settings`: computations run inline,
glibc keeps freed memory), which takes effect only as this process's first use of JAX:
the checkpoints are written by a child process, and nothing touches JAX before it. The
peers get the same host settings from their environment (GLIBC_TUNABLES; tunix's
computations inline).

Time to the first step from launch (the table's last column but one) is measured the
same way for every side, after each setting's rounds: `FIRST_STEP_PROSE` (recorded with
the table) states how; arl's child is `peer_workers/arl_first_step.py`. Its parts are a
line of prose under the table. `--first_step_runs N` takes N pairs (medians); 0 skips it.

The update's FLOP/s (`harness`, "FLOPs") is reported against the float32 matmul peak of
a large `jnp.dot`, the best of its measurements in this run (once the first setting's
sides are ready and after each setting); "executed of peak" is arl's update program's
own matmul FLOPs (`harness.largest_cond_branch_flops`) per second of update.

    python benchmarks/peers.py [--settings=toy,modest,multiturn] [--peers=arl,trl,tunix]
        [--rounds=15] [--first_step_runs=1] [--cache_dir=~/.cache/arl-bench-peers]
        [--record]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=wrong-import-position
import harness  # noqa: E402  pylint: disable=wrong-import-position
from peer_workers import driver  # noqa: E402  pylint: disable=wrong-import-position
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position

from arl import caches  # noqa: E402
from arl.runs import process_settings  # noqa: E402

PEERS = ("arl", "trl", "tunix")
LOAD_WARNING = 1.5  # 1-minute load average above which timings are flagged
ARL_FIRST_STEP = os.path.join(driver.WORKER_DIR, "arl_first_step.py")
FIRST_STEP_RUNS = ("first run", "rerun")


# --------------------------------------------------------------------------- measuring
def run_setting(setting: protocol.Setting, peers, args, log, pythons, failures,
                on_ready=None) -> dict:
    """Builds every side for one setting, then interleaves `args.rounds` rounds;
    `on_ready()` runs once every side is ready, before the rounds."""
    checkpoint = harness.write_checkpoint(setting, args.cache_dir)
    runners = []
    for peer in peers:
        if peer != "arl" and pythons.get(peer) is None:
            continue
        start = time.perf_counter()
        try:
            if peer == "arl":
                runner = harness.ArlRunner(setting, checkpoint, args.warmup, dict(
                    [harness.parse_override(text) for text in args.arl_set]))
            else:
                log_path = os.path.join(args.cache_dir, peer, f"worker-{setting.name}.log")
                runner = driver.WorkerRunner(peer, pythons[peer], setting, checkpoint, args.warmup,
                                      log_path, args.step_timeout)
            runners.append(runner)
        except Exception as e:  # noqa: BLE001 - one side's failure must not stop the rest
            failures.append((setting.name, peer, f"{type(e).__name__}: {e}".splitlines()[0]))
            log(f"[{setting.name}] {peer}: could not start: {failures[-1][2]}")
            continue
        log(f"[{setting.name}] {peer}: started ({time.perf_counter() - start:.0f} s)")
    alive = []
    for runner in runners:
        if isinstance(runner, driver.WorkerRunner):
            try:
                runner.wait_ready(args.ready_timeout)
            except RuntimeError as e:
                failures.append((setting.name, runner.name, str(e)))
                log(f"[{setting.name}] {runner.name}: failed before its first timed step: {e}")
                continue
        alive.append(runner)
        log(f"[{setting.name}] {runner.name}: ready {json.dumps(runner.ready, default=str)}")

    if on_ready is not None:
        on_ready()
    records = {r.name: [] for r in alive}
    load = {"before": common.load_average()}
    for round_index in range(args.rounds):
        for runner in list(alive):
            try:
                records[runner.name].append(runner.step())
            except Exception as e:  # noqa: BLE001 - one side's crash must not stop the rest
                failures.append((setting.name, runner.name, f"crashed in round "
                                 f"{round_index + 1}: {e}"))
                log(f"[{setting.name}] {runner.name}: {failures[-1][2]}")
                alive.remove(runner)
                runner.close()
        log(f"[{setting.name}] round {round_index + 1}/{args.rounds}: " + ", ".join(
            f"{name} {recs[-1]['step_s']:.3f} s" for name, recs in records.items() if recs))
    load["after"] = common.load_average()
    for runner in runners:
        runner.close()
    results = {}
    for runner in runners:
        recs = records.get(runner.name)
        if recs:
            results[runner.name] = summarise(setting, recs, runner.ready)
    return dict(setting=dataclasses.asdict(setting), load=load, results=results,
                checkpoint=checkpoint)


def summarise(setting: protocol.Setting, recs, ready) -> dict:
    steps = [r["step_s"] for r in recs]
    rollouts = [r["rollout_s"] for r in recs]
    step_s = statistics.median(steps)
    rollout_s = statistics.median(rollouts)
    generated = statistics.mean(r["generated_tokens"] for r in recs)
    trained = statistics.mean(r["trained_tokens"] for r in recs)
    update_s = max(step_s - rollout_s, 1e-9)
    rewards = [r["reward_mean"] for r in recs if r.get("reward_mean") is not None]
    return dict(reward_mean=statistics.mean(rewards) if rewards else float("nan"),
        step_s=step_s, step_min=min(steps), step_max=max(steps), rollout_s=rollout_s,
        update_s=update_s, generated_tokens=generated, trained_tokens=trained,
        generated_per_s=generated / step_s, trained_per_s=trained / step_s,
        update_flops=harness.update_flops(setting, trained),
        update_flops_per_s=harness.update_flops(setting, trained) / update_s,
        executed_flops_per_s=(ready["executed_update_flops"] / update_s
                              if ready.get("executed_update_flops") else None),
        ready=ready, rounds=recs)


# ---------------------------------------------------------- first step from launch
def arl_first_step_environment(cache: str) -> dict:
    """The arl child's environment: this process's (arl's path, the XLA flags arl's
    in-process side runs under), with arl's caches in `cache` and no JAX cache setting
    of the user's, so the trainer's `arl.caches` picks `cache`/jax as it picks the
    default cache for a user who set none (and ~/.cache/arl is never touched)."""
    env = driver.child_environment()
    env[caches.CACHE_ENV] = cache
    env[caches.COMPILATION_CACHE_ENV] = os.path.join(cache, "jax")
    return env


def time_first_step(side: str, python: str, setting: protocol.Setting, checkpoint: str,
                    env: dict, log_path: str, timeout: float) -> dict:
    """One fresh process of `side` run up to the end of its first training step (a
    peer's worker with one warm-up step; arl's `peer_workers/arl_first_step.py`):
    `total_s`, the seconds from just before its launch to reading its "ready" line, and
    its parts (`parts`: seconds, and for arl the programs compiled and loaded)."""
    runner = driver.WorkerRunner(side, python, setting, checkpoint, 1, log_path, timeout,
                          script=ARL_FIRST_STEP if side == "arl" else None, env=env)
    try:
        ready = runner.wait_ready(timeout)
    finally:
        runner.close()
    total = runner.ready_s
    if side != "arl":
        parts = {"to the step's start": total - ready["first_step_s"],
                 "of it building the trainer (imports included)": ready["setup_s"],
                 "first step": ready["first_step_s"]}
        return dict(total_s=total, parts=parts)
    phases = ready["phases"]
    step = phases["first step"]
    parts = {"python start": total - sum(p["wall"] for p in phases.values())}
    parts.update((name, phases[name]["wall"]) for name in
                 ("imports", "build trainer", "init state", "first step") if name in phases)
    parts.update({"trace": step["trace"], "lower": step["lower"],
                  "XLA compile or cache load": step["compile"],
                  "programs": sum(p.get("compiled", 0) for p in phases.values()),
                  "from the cache": sum(p.get("cache hits", 0) for p in phases.values())})
    return dict(total_s=total, parts=parts, reward_mean=ready["reward_mean"])


def first_step_phase(setting: protocol.Setting, sides, args, log, pythons,
                     failures) -> dict:
    """Time to the first step from launch: `args.first_step_runs` pairs of fresh
    processes per side (`time_first_step`), the sides interleaved: first run (arl's
    compilation cache an empty temporary directory), then rerun (the same directory,
    as the first run left it). {side: {"first run": s, "rerun": s (medians over the
    pairs), "parts": {run: {part: median}}, "runs": [records]}}; a side that fails is
    reported in `failures` and left out."""
    checkpoint = harness.checkpoint_path(setting, args.cache_dir)
    sides = [side for side in sides if side == "arl" or pythons.get(side) is not None]
    records = {side: [] for side in sides}
    failed = set()
    for pair in range(args.first_step_runs):
        cache = tempfile.mkdtemp(prefix="arl-peers-first-step-")
        try:
            for run in FIRST_STEP_RUNS:
                for side in sides:
                    if side in failed:
                        continue
                    log_dir = os.path.join(args.cache_dir, side)
                    os.makedirs(log_dir, exist_ok=True)
                    log_path = os.path.join(
                        log_dir, f"first-step-{setting.name}-{run.replace(' ', '-')}.log")
                    arl = side == "arl"
                    try:
                        record = time_first_step(
                            side, sys.executable if arl else pythons[side], setting,
                            checkpoint, arl_first_step_environment(cache) if arl
                            else driver.peer_environment(), log_path, args.ready_timeout)
                    except (RuntimeError, KeyError) as e:
                        failed.add(side)
                        failures.append((setting.name, side,
                                         f"first step from launch ({run}): {e}"))
                        log(f"[{setting.name}] {side}: {failures[-1][2]}")
                        continue
                    record.update(run=run, pair=pair, load=common.load_average())
                    if arl:  # the cache the rerun finds
                        record["cache_files"] = sum(
                            len(files) for _, _, files in os.walk(os.path.join(cache, "jax")))
                    records[side].append(record)
                    log(f"[{setting.name}] first step from launch, {run}: {side} "
                        f"{record['total_s']:.1f} s " + json.dumps(
                            {k: round(v, 2) for k, v in record["parts"].items()}))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    out = {}
    for side, recs in records.items():
        if side in failed or not recs:
            continue
        out[side] = {"runs": recs, "parts": {}}
        for run in FIRST_STEP_RUNS:
            mine = [r for r in recs if r["run"] == run]
            out[side][run] = statistics.median(r["total_s"] for r in mine)
            out[side]["parts"][run] = {key: statistics.median(r["parts"][key] for r in mine)
                                       for key in mine[0]["parts"]}
    return out


FIRST_STEP_PROSE = (
    "First step from launch: wall seconds from launching a fresh Python process to the "
    "end of its first training step, timed by this script around the process (so the "
    "interpreter's start, every import, building the trainer and loading the checkpoint "
    "count on every side): arl as a notebook's first cell (`TokenTrainer(arl_config(...))"
    "`, `init_state()`, one `train_step` compiled at its call, its reward read on the "
    "host), TRL and tunix their workers up to the end of their first step. Run after "
    "the setting's rounds with nothing else running, the sides interleaved: first run "
    "with arl's persistent compilation cache in an empty directory, then a rerun with "
    "that directory as the first run left it (TRL and tunix as their libraries come: no "
    "persistent compilation cache). Python's bytecode and the OS's file cache are warm "
    "on every side (each side's libraries were just loaded for the rounds).")


def first_step_cell(first_steps, name: str) -> str:
    if first_steps is None:
        return "not run"
    side = first_steps.get(name)
    return "n/a" if side is None else f"{side['first run']:.1f} / {side['rerun']:.1f}"


def first_step_details(first_steps) -> str:
    """The parts of each side's time to the first step, first run / rerun, as prose."""
    if not first_steps:
        return ""

    def pair(part, values, digits):
        return f"{part} " + " / ".join(f"{values[run][part]:.{digits}f}"
                                      for run in FIRST_STEP_RUNS)

    sides = []
    for name, side in first_steps.items():
        values = side["parts"]
        if name == "arl":
            steps = ", ".join(pair(p, values, 1) for p in (
                "trace", "lower", "XLA compile or cache load"))
            main = ", ".join(pair(p, values, 1) for p in (
                "python start", "imports", "build trainer", "init state", "first step")
                if p in values[FIRST_STEP_RUNS[0]])
            text = (f"{main} (of it {steps}); {pair('programs', values, 0)}, "
                    f"{pair('from the cache', values, 0)}")
        else:
            text = ", ".join(pair(p, values, 1) for p in values[FIRST_STEP_RUNS[0]])
        sides.append(f"{name}: {text}")
    return ("First step from launch, its parts (s, first run / rerun; medians over "
            f"{len(next(iter(first_steps.values()))['runs']) // len(FIRST_STEP_RUNS)} "
            "pair(s) of runs): " + "; ".join(sides) + ".")


def table(result: dict, peak: float) -> str:
    rows = []
    for name, r in result["results"].items():
        rows.append((
            name, f"{r['step_s']:.3f}", f"{r['step_min']:.3f}-{r['step_max']:.3f}",
            f"{r['rollout_s']:.3f}", f"{r['update_s']:.3f}",
            common.fmt_rate(r["generated_per_s"]), common.fmt_rate(r["trained_per_s"]),
            f"{r['update_flops_per_s'] / 1e9:.2f}",
            f"{100 * r['update_flops_per_s'] / peak:.1f}%",
            ("n/a" if r.get("executed_flops_per_s") is None
             else f"{100 * r['executed_flops_per_s'] / peak:.1f}%"),
            first_step_cell(result.get("first_step"), name),
            f"{r['reward_mean']:.3f}"))
    return common.markdown_table(
        ["side", "s/step (median)", "min-max", "rollout s", "update s", "generated tok/s",
         "trained tok/s", "update GFLOP/s", "of peak", "executed of peak",
         "first step from launch (s): first run / rerun",
         "reward mean"],
        rows)


def setting_line(s: protocol.Setting) -> str:
    model = (f"{s.num_layers} layers, d {s.d_model}, MLP {s.mlp_dim}, vocab {s.vocab}, "
             f"{s.num_heads} heads / {s.num_kv_heads} KV heads, q/k/v biases")
    if s.turns:
        work = (f"guess_number (max_n 16), {s.turns} turns of up to {s.gen_len} tokens; "
                f"{s.num_prompts} prompts x {s.group_size} samples")
    else:
        work = (f"{s.num_prompts} prompts x {s.group_size} samples, {s.prompt_len} prompt + "
                f"{s.gen_len} generated tokens")
    return f"**{s.name}**: {model}; {work}"


def versions_line(results) -> str:
    parts = [f"JAX {jax.__version__} (arl)"]
    for run in results:
        for name, r in run["results"].items():
            v = r["ready"].get("versions")
            if v:
                parts.append(f"{name}: " + ", ".join(f"{k} {x}" for k, x in v.items()))
    return "; ".join(dict.fromkeys(parts))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="toy,modest,multiturn",
                        help=f"comma-separated, from {sorted(protocol.SETTINGS)}")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated, from {PEERS}")
    # 15: the records of 2026-12-02 used 15; a median of 5 moves with one or two slow
    # rounds (the machine's speed also drifts between runs, which no round count removes).
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps on every side before the rounds (>= 1)")
    parser.add_argument("--cache_dir", "--cache-dir",
                        default=os.path.expanduser("~/.cache/arl-bench-peers"),
                        help="where the peers' virtual environments, the shared "
                             "checkpoints and the workers' logs live")
    parser.add_argument("--peak_size", "--peak-size", type=int, default=1024,
                        help="side of the square float32 matmul that measures the peak")
    parser.add_argument("--ready_timeout", "--ready-timeout", type=float, default=900.0,
                        help="seconds a worker may take to build and warm up")
    parser.add_argument("--step_timeout", "--step-timeout", type=float, default=600.0,
                        help="seconds one timed step may take")
    parser.add_argument("--arl_set", "--arl-set", action="append", default=[],
                        metavar="KEY=VALUE", help="a config override of arl's side, e.g. "
                        "updates.reuse_rollout_activations=False (repeatable)")
    parser.add_argument("--first_step_runs", "--first-step-runs", type=int, default=1,
                        help="pairs of fresh processes per side and setting timed from "
                             "launch to the end of their first step (first run with an "
                             "empty arl compilation cache, rerun with it filled), after "
                             "the setting's rounds; 0 skips them")
    parser.add_argument("--record", action="store_true",
                        help="write the tables as the Peers section of benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    settings = protocol.setting_names(parser, args.settings)
    peers = [p for p in args.peers.split(",") if p]
    if not peers or any(p not in PEERS for p in peers):
        parser.error(f"--peers: {args.peers!r}; allowed values are {PEERS}")
    if args.rounds < 1 or args.warmup < 1:
        parser.error("--rounds and --warmup must be >= 1")
    if args.first_step_runs < 0:
        parser.error(f"--first_step_runs: {args.first_step_runs}; must be >= 0 (0 skips "
                     "the time to the first step)")
    args.cache_dir = os.path.abspath(os.path.expanduser(args.cache_dir))
    os.makedirs(args.cache_dir, exist_ok=True)

    def log(text):
        print(text, flush=True)

    # arl's side is built as a notebook builds it: `arl.setup()` first, before any use
    # of JAX in this process (the library's host settings, `arl.runs.process_settings`);
    # the checkpoints are written by a child process, and the machine line and the
    # first peak measurement wait for the first setting's trainers. The peers get the
    # same settings from their environment (driver.WorkerRunner).
    process_settings.setup()
    harness.write_checkpoints([protocol.SETTINGS[name] for name in settings], args.cache_dir)
    load_start = common.load_average()
    if load_start > LOAD_WARNING:
        log(f"WARNING: 1-minute load average {load_start:.2f} > {LOAD_WARNING}: other jobs "
            "share this machine; read the ratios of the interleaved rounds, not the times")
    failures = []
    pythons = {}
    install_notes = {}
    for peer in peers:
        if peer == "arl":
            continue
        pythons[peer], install_notes[peer] = driver.peer_python(peer, args.cache_dir, log)
        if pythons[peer] is None:
            failures.append(("all", peer, install_notes[peer]))
            log(f"[{peer}] skipped: {install_notes[peer]}")

    peaks = []

    def measure_peak():
        peaks.append(common.matmul_peak_flops(args.peak_size, repeats=10))
        log(f"float32 matmul peak ({args.peak_size}^2 jnp.dot): {peaks[-1] / 1e9:.1f} GFLOP/s"
            f" (best so far {max(peaks) / 1e9:.1f})")

    def first_ready():
        log(f"machine: {common.machine_line()}")
        measure_peak()

    results = []
    for name in settings:
        setting = protocol.SETTINGS[name]
        log(f"== {setting_line(setting)}")
        result = run_setting(setting, peers, args, log, pythons, failures,
                             on_ready=None if results else first_ready)
        results.append(result)
        measure_peak()
        if args.first_step_runs:
            load = common.load_average()
            result["first_step"] = first_step_phase(setting, peers, args, log, pythons,
                                                    failures)
            result["first_step_load"] = (load, common.load_average())
        else:
            result["first_step"] = None
        log(table(result, max(peaks)))
        if result["first_step"]:
            log(first_step_details(result["first_step"]))
    peak = max(peaks)
    load_end = common.load_average()
    inline, kept = process_settings.applied()
    allocator_line = (
        f"arl: the library's defaults as `arl.setup()` applies them (`arl.runs.process_settings`"
        f": computations {'inline' if inline else 'dispatched asynchronously'}, freed "
        f"memory {'kept mapped' if kept else 'returned (glibc defaults)'}); the peers: "
        f"freed memory kept mapped (GLIBC_TUNABLES={process_settings.GLIBC_TUNABLES}) and JAX "
        f"computations inline (tunix; torch runs inline)")
    log(f"allocator: {allocator_line}")
    arl_line = ("`default_config()` with the equal-work settings only (`arl_config`), "
                "built by `TokenTrainer` as in a notebook")
    if args.arl_set:
        arl_line += f", overridden by {', '.join(args.arl_set)} (not the defaults)"

    blocks = []
    for result in results:
        details = first_step_details(result["first_step"])
        if details:
            before, after = result["first_step_load"]
            details = f"\n{details} Load {before:.2f} -> {after:.2f}.\n"
        blocks.append(f"{setting_line(protocol.SETTINGS[result['setting']['name']])} "
                      f"(load {result['load']['before']:.2f} -> {result['load']['after']:.2f})"
                      f"\n\n{table(result, peak)}\n{details}")
    def without_log(reason):  # the recorded text names no machine paths
        return re.sub(r" [(]log: [^)]*[)]", "", reason)

    failure_lines = "".join(f"- {setting} / {peer}: {without_log(reason)}\n"
                            for setting, peer, reason in failures)
    loaded = max(load_start, load_end) > LOAD_WARNING
    environments = ", ".join(f"{k} {v}" for k, v in install_notes.items()) or "none"
    text = (common.heading("peers.py")
            + f"1-minute load average {load_start:.2f} at the "
            f"start, {load_end:.2f} at the end"
            f"{f' (ABOVE {LOAD_WARNING}: other jobs were running)' if loaded else ''}. "
            f"Versions: {versions_line(results)}. Peer environments: {environments}.\n\n"
            f"arl's configuration: {arl_line}.\n\n"
            f"Median of {args.rounds} interleaved rounds after {args.warmup} warm-up steps per "
            f"side; TRL's torch threads: one per core; host allocator: {allocator_line}; "
            f"rollout = generation alone (arl: its "
            f"rollout compiled on its own), update = step - rollout. FLOP/s: model FLOPs of "
            f"the update (3 x trained tokens x (2 x matmul params + 4 x layers x length x d)) "
            f"/ update time, against the float32 matmul peak of {peak / 1e9:.1f} GFLOP/s, "
            f"the best of {len(peaks)} measurements in this run (once the first setting's "
            f"sides were ready and after each setting: "
            f"{min(peaks) / 1e9:.0f}-{peak / 1e9:.0f}); executed of peak (arl): the "
            f"matmul FLOPs its update program contains (the reused forward products and the "
            f"groups' repeated prompts are not in it) / update time. {FIRST_STEP_PROSE}\n\n"
            + "\n".join(blocks)
            + (f"\nNot compared:\n\n{failure_lines}" if failures else ""))
    common.publish("Peers: arl vs TRL vs tunix, equal-work GRPO step", text, args.record)
    return dict(results=results, failures=failures, peak=peak, load=(load_start, load_end),
                text=text)


if __name__ == "__main__":
    main()
