"""Mutation check: do the tests bite? Each mutation below is a small wrong change of the
code (a flipped sign, swapped clip bounds, a term switched off, a rounding); the runner
applies it to a scratch copy of the working tree and runs the default-suite tests that
should catch it. A mutation the tests let through is a hole in the tests.

    python -m tests.mutations.run                 # every mutation, after a clean baseline
    python -m tests.mutations.run entropy_sign kl_in_reward_sign
    python -m tests.mutations.run --list

It prints one table row per mutation: CAUGHT (a listed test failed), MISSED (all
passed), or DOES NOT APPLY (the code it edits has moved: update its `old` text here).
The baseline first runs the same tests on the unmutated copy; they must pass. Each run
is `pytest -n 0` on the scratch copy with the suite's own conftest (tests/xla_flags.py).
Exit status 0 when every mutation is caught.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # file to edit, relative to the repository root
    old: str  # exact text, found once
    new: str
    tests: tuple[str, ...]  # pytest node ids, one of which must fail
    why: str = ""


PPO_CLIPS = ("clip_low=settings.clip_low,\n"
             "                           clip_high=settings.clip_high,")
UPDATE_ORACLE = ("tests/test_update_oracle.py::"
                 "test_loss_metrics_and_gradient_equal_the_oracle_in_each_aggregation[token-mean]")

MUTATIONS = (
    Mutation("entropy_sign", "arl/trainers/update.py",
             "total = total - c.entropy_coef * alg.aggregate(ent",
             "total = total + c.entropy_coef * alg.aggregate(ent", (UPDATE_ORACLE,),
             "the entropy bonus becomes a penalty"),
    Mutation("clip_swap", "arl/algorithm_table.py",
             PPO_CLIPS, PPO_CLIPS.replace("settings.clip_low", "settings.CLIP").replace(
                 "settings.clip_high", "settings.clip_low").replace("CLIP", "clip_high"),
             (UPDATE_ORACLE,),
             "clip_low and clip_high exchanged"),
    Mutation("clips_x5", "arl/algorithm_table.py",
             PPO_CLIPS, PPO_CLIPS.replace("=settings.", "=5 * settings."),
             (UPDATE_ORACLE,), "both policy clip ranges five times wider"),
    Mutation("dual_clip_off", "arl/algorithm_table.py",
             "dual_clip=settings.dual_clip or None,", "dual_clip=None,", (UPDATE_ORACLE,),
             "loss.dual_clip ignored"),
    Mutation("value_clip_off", "arl/trainers/update.py",
             "clip=c.value_clip or None,", "clip=None,", (UPDATE_ORACLE,),
             "loss.value_clip ignored"),
    Mutation("kl_in_reward_sign", "arl/trainers/token.py",
             "rewards = rewards - c.loss.kl_coef * alg.kl_penalty(",
             "rewards = rewards + c.loss.kl_coef * alg.kl_penalty(",
             ("tests/test_credit_oracle.py::"
              "test_kl_in_reward_lowers_the_reward_where_the_policy_is_likelier",),
             "the KL penalty in the reward becomes a bonus"),
    Mutation("filtered_rows_in_the_loss", "arl/trainers/token.py",
             "loss_mask = mask * signals.valid[:, None]", "loss_mask = mask",
             ("tests/test_step_wiring.py::"
              "test_the_update_batch_holds_the_signals_on_the_kept_rows[grpo]",),
             "the rows the filters drop (signals.valid) stay in the loss mask"),
    Mutation("returns_not_passed", "arl/trainers/token.py",
             "old_values=old_values, returns=signals.returns,",
             "old_values=old_values, returns=old_values,",
             ("tests/test_step_wiring.py::"
              "test_the_update_batch_holds_the_signals_on_the_kept_rows[ppo]",),
             "the critic regresses on its own old values instead of the returns"),
    Mutation("bf16_attention_accumulator", "arl/models/attention.py",
             "            return m_new, l, alpha[..., None] * acc + pv\n\n        init",
             "            return m_new, l, (alpha[..., None] * acc + pv).astype(vb.dtype)"
             ".astype(jnp.float32)\n\n        init",
             ("tests/models/test_attention.py::"
              "test_blocked_attention_bfloat16_accumulates_in_float32",),
             "the blocked attention's accumulator rounded to the value dtype after each block"),
    Mutation("one_ulp_initial_parameters", "arl/trainers/policy.py",
             '        return nn.unbox(self.model.init(key, dummy)["params"])',
             '        params = nn.unbox(self.model.init(key, dummy)["params"])\n'
             '        first = lambda x: (0,) * x.ndim  # noqa: E731\n'
             '        return jax.tree.map(lambda x: x.at[first(x)].set(jnp.nextafter(\n'
             '            x[first(x)], jnp.inf)), params)',
             ("tests/test_golden_run.py::test_golden_run[grpo_bandit]",),
             "the first element of every initial parameter array one ulp up (caught bit for "
             "bit on a processor with a recording)"),
)


def _scratch_copy() -> str:
    """The working tree's files (tracked and untracked, not ignored) in a temporary
    directory."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    scratch = tempfile.mkdtemp(prefix="arl-mutation-")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(scratch, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(scratch, rel))
    return scratch


def _pytest(scratch: str, tests) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=scratch)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0",
                           "-q", "-x", *tests], cwd=scratch, env=env, capture_output=True,
                          text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    # The first error line names what failed (an assertion, or an exception that would
    # mean the mutation broke the program rather than the numbers).
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    summary = (" ".join(e for e in errors[:4] if e) if errors else
               lines[-1] if lines else proc.stderr.strip()[-200:])
    return proc.returncode, " ".join(summary.split())[:150].replace("|", "/")


def _apply(scratch: str, mutation: Mutation) -> bool:
    path = os.path.join(scratch, mutation.path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.count(mutation.old) != 1:
        return False
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(mutation.old, mutation.new))
    return True


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for m in MUTATIONS:
            print(f"{m.name:28s} {m.path}: {m.why}\n{'':28s} {' '.join(m.tests)}")
        return 0
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    unknown = set(argv) - {m.name for m in MUTATIONS}
    if unknown:
        sys.exit(f"unknown mutations {sorted(unknown)}; --list shows them")
    scratch = _scratch_copy()
    try:
        tests = sorted({t for m in chosen for t in m.tests})
        start = time.time()
        rc, summary = _pytest(scratch, tests)
        print(f"baseline: {summary} ({time.time() - start:.0f} s)")
        if rc != 0:
            print("the baseline fails: fix the tests before mutating")
            return 2
        rows, missed = [], 0
        for m in chosen:
            mutated = _scratch_copy()
            try:
                start = time.time()
                if not _apply(mutated, m):
                    verdict, summary = "DOES NOT APPLY", f"text not found once in {m.path}"
                else:
                    rc, summary = _pytest(mutated, m.tests)
                    verdict = "CAUGHT" if rc == 1 else ("MISSED" if rc == 0 else f"ERROR rc={rc}")
            finally:
                shutil.rmtree(mutated, ignore_errors=True)
            missed += verdict != "CAUGHT"
            rows.append((m.name, verdict, f"{time.time() - start:.0f} s", summary))
            print(f"{m.name}: {verdict} ({summary})", flush=True)
        print("\n| mutation | verdict | time | pytest |\n|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return 1 if missed else 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
