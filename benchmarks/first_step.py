"""Time to the first logged step: where a short run's start-up goes, cold and warm cache.

Three cases, each run in a fresh Python process (so imports count) twice in a row
with one cache directory ($ARL_CACHE_DIR of the run, fresh per case): the first run
finds an empty persistent compilation cache ("cold"), the second the programs of the
first ("warm").

* quickstart: the README's Quickstart, `experiments.train --config=configs/grpo_bandit.py`
  (through the CLI; `train_steps` = `log_every` = 5, so the first logged step is 5).
* multiturn: the `multiturn` setting of `benchmarks/peers.py` through the public API as
  a notebook builds it (`harness.notebook_first_step`: `TokenTrainer(arl_config(...))`,
  `init_state()`, which loads the setting's Hugging Face checkpoint, written beforehand
  by this script, as the peers load it, and one `train_step`, its reward on the host).
* dataset: a new user's tiny `dataset_task` run through the CLI: `grpo_word_problems`
  on a 20-line JSONL (built into a dataset on first use), 10 SFT warm-start steps, first
  logged step 5.

Phases: the process's start, imports, config (loading and validation; the CLI's flag
parsing), building the trainer (environment, model), the initial state (init or
checkpoint load), the warm start, the first step, the steps up to the first log,
evaluation, and the rest (checkpoint manager, writers), timed by `harness.Timeline`
(wall seconds, and of them JAX's trace / lower / compile-or-load seconds, programs
compiled and cache hits). A cache hit in the cold run is a program compiled a second
time in the same process.

    python benchmarks/first_step.py [--cases quickstart,multiturn,dataset]
        [--runs 2] [--code DIR] [--before DIR] [--record]

`--code DIR` runs the cases on the arl checkout in DIR; `--before DIR` first runs each
case once on the checkout in DIR (e.g. `git archive` of an older commit), as a "before"
column; `ARL_COMPILATION_CACHE=0` runs them without arl's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import harness  # noqa: E402  pylint: disable=wrong-import-position  (standard library only)
from peer_workers import protocol  # noqa: E402  pylint: disable=wrong-import-position

REPO = os.path.dirname(BENCH_DIR)
CASES = ("quickstart", "multiturn", "dataset")
PHASES = ("python start", "imports", "config", "build trainer", "init state",
          "warm start", "first step", "steps to first log", "evaluation", "other")
_MARK = "@@first_step "
DATASET_ROWS = 20


# ---------------------------------------------------------------------------- child
def _instrument(timeline: harness.Timeline, steps_to_log: int):
    """Wraps the experiment loop's trainer and writer so that their calls mark phases."""
    from arl.runs import experiment  # pylint: disable=import-outside-toplevel
    from arl.runs import writers  # pylint: disable=import-outside-toplevel

    build = experiment.trainers_lib.build

    def timed(name, fn):
        def call(*args, **kwargs):
            with timeline.phase(name):
                return fn(*args, **kwargs)
        return call

    def built(config, **kwargs):
        with timeline.phase("build trainer"):
            trainer = build(config, **kwargs)
        trainer.init_state = timed("init state", trainer.init_state)
        trainer.warm_start = timed("warm start", trainer.warm_start)
        trainer.evaluation_report = timed("evaluation", trainer.evaluation_report)
        step, calls = trainer.train_step, []

        def train_step(state):
            calls.append(None)
            name = "first step" if len(calls) == 1 else "steps to first log"
            with timeline.phase(name):
                out = step(state)
                import jax  # pylint: disable=import-outside-toplevel
                return jax.block_until_ready(out)

        trainer.train_step = train_step
        return trainer

    experiment.trainers_lib.build = built
    write = writers.MetricsWriter.write

    def first_write(self, step, metrics):
        record = write(self, step, metrics)
        if timeline.done is None and step >= steps_to_log:
            timeline.finish()
        return record

    writers.MetricsWriter.write = first_write


def _cli_case(timeline: harness.Timeline, args) -> None:
    from experiments import cli  # pylint: disable=import-outside-toplevel
    from experiments import train  # pylint: disable=import-outside-toplevel
    from arl.runs import experiment  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    import arl  # pylint: disable=import-outside-toplevel
    configs = os.path.join(os.path.dirname(os.path.dirname(arl.__file__)), "configs")
    if args.child == "quickstart":
        flags = [f"--config={os.path.join(configs, 'grpo_bandit.py')}"]
    else:
        flags = [f"--config={os.path.join(configs, 'grpo_word_problems.py')}",
                 f"--config.env.kwargs.path={args.jsonl}",
                  "--config.warm_start.sft_steps=10"]
    _instrument(timeline, steps_to_log=5)
    timeline.listen()
    timeline.enter("config")
    sys.argv = ["experiments.train", f"--workdir={args.workdir}", *flags,
                "--config.train_steps=5", "--config.log_every=5"]
    try:
        cli.run(train.main)
    except SystemExit as stop:
        if stop.code:
            raise
    timeline.enter("other")


def _api_case(timeline: harness.Timeline, args) -> None:
    harness.notebook_first_step(timeline, protocol.SETTINGS["multiturn"], args.checkpoint)


def child(args) -> None:
    timeline = harness.Timeline(args.spawned)
    start = time.perf_counter()
    (_api_case if args.child == "multiturn" else _cli_case)(timeline, args)
    report = timeline.report()
    first_log = (timeline.done - start) + report["python start"]["wall"]
    print(_MARK + json.dumps(dict(phases=report, first_log=first_log,
                                  programs=timeline.programs)), flush=True)


# --------------------------------------------------------------------------- parent
def _write_inputs(case: str, root: str) -> dict:
    """The case's inputs, outside its cache: the peers' checkpoint, the tiny JSONL."""
    os.makedirs(root, exist_ok=True)
    if case == "multiturn":
        code = (f"import sys; sys.path.insert(0, {BENCH_DIR!r}); import harness; "
                "from peer_workers import protocol; "
                f"print(harness.write_checkpoint(protocol.SETTINGS['multiturn'], {root!r}))")
        path = subprocess.run([sys.executable, "-c", code], check=True, text=True,
                              capture_output=True, env=_env(None, root)).stdout.split()[-1]
        return {"checkpoint": path}
    if case == "dataset":
        path = os.path.join(root, "tiny.jsonl")
        with open(os.path.join(REPO, "arl", "data", "arithmetic_word_problems.jsonl"),
                  encoding="utf-8") as source, open(path, "w", encoding="utf-8") as out:
            out.writelines(line for _, line in zip(range(DATASET_ROWS), source))
        return {"jsonl": path}
    return {}


def _env(code: str | None, cache_root: str) -> dict:
    env = dict(os.environ, ARL_CACHE_DIR=cache_root, JAX_PLATFORMS="cpu")
    for name in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR"):  # XLA's defaults, arl's cache
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (code or REPO, env.get("PYTHONPATH", "")) if p)
    return env


def run_case(case: str, runs: int, code: str | None, before: str | None) -> list[dict]:
    """`runs` fresh processes of `case` sharing one fresh cache root: cold, then warm;
    first one process of the checkout `before` (its own fresh cache root) if given."""
    root = tempfile.mkdtemp(prefix=f"arl-first-step-{case}-")
    try:
        inputs = _write_inputs(case, os.path.join(root, "inputs"))
        plan = ([(before, os.path.join(root, "cache-before"))] if before else [])
        plan += [(code, os.path.join(root, "cache"))] * runs
        results = []
        for index, (checkout, cache_root) in enumerate(plan):
            workdir = os.path.join(root, f"run{index}")  # a fresh workdir: no resume
            command = [sys.executable, os.path.abspath(__file__), "--child", case,
                       "--workdir", workdir, "--spawned", repr(time.time())]
            command += [f"--{k}={v}" for k, v in inputs.items()]
            load = os.getloadavg()[0]
            done = subprocess.run(command, env=_env(checkout, cache_root), text=True,
                                  capture_output=True, check=False)
            lines = [l for l in done.stdout.splitlines() if l.startswith(_MARK)]
            if done.returncode or not lines:
                raise SystemExit(f"{case} run {index + 1} failed ({done.returncode}):\n"
                                 + done.stderr[-3000:])
            result = json.loads(lines[-1][len(_MARK):])
            result["load"] = load
            results.append(result)
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


# A phase shorter than this in every run of a case is left out of the table (the first
# logged step, its last row, counts it).
SHOWN_PHASE_SECS = 0.5


def columns(results: list[dict], before: bool) -> list[str]:
    labels = (["before"] if before else []) + ["cold", "warm"] + [
        f"run {i + 1}" for i in range(2, len(results))]
    return ["case", "phase"] + [f"{labels[i]}: s (trace / lower / compile)"
                                for i in range(len(results))] + [
        "programs compiled (cache hits)"]


def rows(case: str, results: list[dict]) -> list[list[str]]:
    """One case's rows of the table: its phases of SHOWN_PHASE_SECS or more in some run,
    then its first logged step."""
    out = []
    for phase in PHASES:
        cells, shown = [], False
        for result in results:
            p = result["phases"].get(phase)
            if p is None or p["wall"] < 0.005:
                cells.append("")
                continue
            shown = shown or p["wall"] >= SHOWN_PHASE_SECS
            jit = (f" ({p['trace']:.1f} / {p['lower']:.1f} / {p['compile']:.1f})"
                   if p["trace"] + p["lower"] + p["compile"] >= 0.05 else "")
            cells.append(f"{p['wall']:.1f}{jit}")
        counts = [result["phases"].get(phase, {}) for result in results]
        programs = " / ".join(f"{c.get('compiled', 0)} ({c.get('cache hits', 0)})"
                              for c in counts)
        if shown:
            out.append([case, phase, *cells, programs])
    out.append([case, "**first logged step**",
                *[f"**{r['first_log']:.1f}** (load {r['load']:.1f})" for r in results], ""])
    return out


def programs_line(results: list[dict]) -> str:
    """The programs that took a second or more to compile in the cold run, with their
    seconds warm (loaded from the cache, or compiled again), and repeats (a program
    compiled twice in one process)."""
    def seconds(result):
        out = {}
        for phase, name, secs, hit in result["programs"]:
            if phase in PHASES:
                out.setdefault((phase, name), []).append((secs, hit))
        return out

    cold = seconds(results[0])
    warm = seconds(results[1]) if len(results) > 1 else {}
    parts = []
    for (phase, name), runs in sorted(cold.items(), key=lambda kv: -sum(s for s, _ in kv[1])):
        if sum(s for s, _ in runs) < 1.0:
            continue
        text = f"{name} ({phase}) {' + '.join(f'{s:.1f}' for s, _ in runs)} s"
        if (phase, name) in warm:
            text += " -> " + " + ".join(f"{s:.1f}{'' if h else ' (compiled)'}"
                                        for s, h in warm[(phase, name)]) + " s"
        parts.append(text)
    repeats = sum(h for r in results[:1] for _, _, _, h in r["programs"])
    return (f"Programs over 1 s (cold -> warm): {'; '.join(parts) or 'none'}. "
            f"Programs compiled twice in the cold run: {repeats}.")


def markdown(header, body) -> str:
    """A table whose first two columns (case, phase) are text and the others numbers."""
    lines = ["| " + " | ".join(header) + " |",
             "|---|---|" + "|".join("---:" for _ in header[2:]) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |"
                              for row in body])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, from {CASES}")
    parser.add_argument("--runs", type=int, default=2,
                        help="processes per case, one cache: cold, then warm (>= 1)")
    parser.add_argument("--code", default=None,
                        help="an arl checkout to run instead of this one")
    parser.add_argument("--before", default=None,
                        help="an arl checkout (e.g. an older commit) run once per case "
                             "first, as a 'before' column")
    parser.add_argument("--record", action="store_true",
                        help="write the tables as a section of benchmarks/RESULTS.md")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--jsonl", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    cases = [c for c in args.cases.split(",") if c]
    if not cases or any(c not in CASES for c in cases) or args.runs < 1:
        parser.error(f"--cases: from {CASES}; --runs >= 1")
    table_rows, notes, header = [], [], None
    for case in cases:
        results = run_case(case, args.runs, args.code, args.before)
        header = columns(results, before=bool(args.before))
        case_rows = rows(case, results)
        table_rows += case_rows
        notes.append(f"{case}: " + programs_line(results[1:] if args.before else results))
        print(markdown(header, case_rows) + "\n\n" + notes[-1] + "\n", flush=True)
    import common  # pylint: disable=import-outside-toplevel
    text = (common.heading("first_step.py")
            + "Each case in fresh processes sharing one fresh cache directory: cold = "
            "empty persistent compilation cache, warm = the cold run's programs. Seconds "
            "of wall time per phase; in brackets the seconds JAX spent tracing / lowering "
            "/ compiling or loading from the cache; programs compiled (cold / warm) with "
            "the cache hits among them. First logged step: seconds from the process's "
            "start, with the 1-minute load average before the run."
            + (" Before: one process of the older checkout." if args.before else "")
            + f" Phases under {SHOWN_PHASE_SECS} s in every run are left out."
            + "\n\n" + markdown(header, table_rows) + "\n\n" + "\n\n".join(notes))
    if args.record:
        print(f"recorded in {common.record_section('Time to the first step', text)}")
    return None


if __name__ == "__main__":
    main()
