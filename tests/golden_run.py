"""Golden runs: the metrics of the first steps of every shipped config, at reduced sizes.

A refactor changes structure, not numbers. `tests/test_golden_run.py` runs each case
below through the real experiment loop (`arl.runs.experiment.run`: warm start, train steps, greedy
and sampled evaluation) and compares every logged metric with the values recorded in
`tests/golden/<processor>/<case>.json`.

Record again only when a change is MEANT to change numbers, and say so in the commit
message: a semantic fix, or a faster computation of the same function that rounds
differently (e.g. a hand-written backward pass), which then comes with a test of the new
path against the previous one at float tolerance. The numbers belong to one JAX/XLA
build: the test extra of setup.py pins the JAX they were recorded with.

    python -m tests.golden_run --record              # every case; numbers meant to change
    python -m tests.golden_run --record grpo_bandit
    python -m tests.golden_run --add-processor       # same code, this processor's rounding
    python -m tests.golden_run --rooms grpo_bandit   # what the test measures off recording

Recording uses the test suite's XLA flags (tests/xla_flags.py), so the numbers are those
the tests compute.

The last bits also belong to the CPU: XLA:CPU's dot and reduction kernels choose their
blocking, vector width and bfloat16 path by the host processor at run time, so two x86
machines with the same JAX round differently, and a run amplifies that over the warm
start's 40 SFT steps and its RL steps (seen: 1e-7 to 1e-5 relative on losses between AMD
Zen 4 and Zen 5; on a Zen 3 another sampled episode at step 2 of `ppo_clipping`, and in
bfloat16 other episodes from step 1). So the recordings are kept per processor:
`tests/golden/<processor>/` holds one processor's recordings and its `host.json` names it
(`host_signature`: vendor, family, model, stepping, cache, a digest of the feature flags,
cores).

* On a processor with a recording of the case, the test compares bit for bit: any change
  of any logged number fails.
* On any other processor (or with ARL_GOLDEN_UNRECORDED=1), no room measured elsewhere
  bounds what this processor's kernels do, so the test measures one here: it runs the
  case twice, as it is and with every initial parameter one ulp up in its own dtype
  (`perturbed_rounding`: the same computation from a rounding-sized different start),
  and `rooms` turns the two runs' differences into a room per metric and step
  (ROOM_FACTOR x the largest difference so far, steadied by the median over the
  record's continuous metrics, at least MIN_RTOL). Each logged value must lie within
  its room of the closest recording. What the perturbation did not move compares
  exactly: the records' keys and steps, and the decisions (the episodes' statistics,
  clip fractions) while no decision has flipped. From the first record where one did,
  or where a clip binds, the runs follow other sample paths and nothing is compared;
  nor is a value whose room spans the value itself. The test names and counts what it
  could not compare (`GoldenRoomWarning` in pytest's warnings summary; a case with
  nothing left to compare is skipped with that reason). The wiring is guarded by the
  oracles (tests/test_update_oracle.py, tests/test_credit_oracle.py,
  tests/test_step_wiring.py) on every processor.

  Why an ulp of the initial parameters and not an XLA flag: the suite compiles at LLVM
  level 0 (tests/xla_flags.py), where `--xla_cpu_max_isa=AVX2` moves no golden number,
  and a flag would compile every program again in another process; the perturbed run
  loads the compiled programs from the run's compilation cache (tests/conftest.py), so
  it costs the run's execution, not its compilation. docs/testing.md has the rooms and
  spreads measured on a Zen 3 against the Zen 4 and Zen 5 recordings.

`--record` drops the other processors' recordings of the recorded cases (they hold the
old numbers); `--add-processor` adds this processor's recordings of the same code next
to the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile

if __name__ == "__main__":  # the same backend settings as the test suite
    from tests import xla_flags

    xla_flags.set_suite_flags()

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
HOST_FILE = "host.json"
STEPS = 3
# Off the recording processors: a metric's room is ROOM_FACTOR x its measured spread
# under `perturbed_rounding` (other processors' kernels moved the compared metrics by up
# to 21 x that: `vineppo_guess_number`'s first grad_norm on a Zen 5, docs/testing.md), at
# least MIN_RTOL (a few float32 ulps).
ROOM_FACTOR, MIN_RTOL = 50.0, 1e-6
# The metrics are float32 statistics of O(1) terms: below a few ulps of 1 in absolute
# value a continuous metric is a near-cancellation that rounding moves whole (a k3 KL
# estimate of 3e-14 on one processor, 6e-14 on another), so its room is at least this.
MIN_ATOL = 1e-6
# Set (to anything but "0"): compare as on a processor with no recording, here too.
UNRECORDED_ENV = "ARL_GOLDEN_UNRECORDED"


def _cpuinfo() -> dict[str, str]:
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor describes them all
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def host_signature() -> str:
    """The processor as XLA:CPU's code generation sees it: vendor, family, model and
    stepping, cache size, a digest of the feature flags, and the core count."""
    fields = _cpuinfo()
    if not fields:
        return f"{platform.machine()} {platform.processor()} x{os.cpu_count()}"
    flags = hashlib.sha1(fields.get("flags", "").encode()).hexdigest()[:10]
    return (f"{fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')} stepping {fields.get('stepping', '?')}, cache "
            f"{fields.get('cache size', '?')}, flags {flags}, {os.cpu_count()} cores")


def processor_dir_name(signature: str) -> str:
    """A directory name for a processor: a readable prefix and a digest of the whole
    signature (e.g. `AuthenticAMD-family-25-model-17-3f0c9a1b`)."""
    readable = re.sub(r"[^A-Za-z0-9]+", "-", signature.split(",")[0]).strip("-")
    digest = hashlib.sha1(signature.encode()).hexdigest()[:8]
    return f"{readable}-{digest}"


def processors() -> dict[str, str]:
    """{signature: directory} of every processor with recordings."""
    out = {}
    if not os.path.isdir(GOLDEN_DIR):
        return out
    for entry in sorted(os.listdir(GOLDEN_DIR)):
        host_file = os.path.join(GOLDEN_DIR, entry, HOST_FILE)
        if os.path.isfile(host_file):
            with open(host_file, encoding="utf-8") as f:
                out[json.load(f)["host"]] = os.path.join(GOLDEN_DIR, entry)
    return out


def recordings(name: str) -> dict[str, list[dict]]:
    """{processor signature: records} of case `name`, over every processor with one."""
    out = {}
    for signature, directory in processors().items():
        path = os.path.join(directory, f"{name}.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                out[signature] = json.load(f)
    return out


def recorded_here(name: str) -> list[dict] | None:
    """This processor's recording of case `name` (None: none, or UNRECORDED_ENV set)."""
    if os.environ.get(UNRECORDED_ENV, "0") not in ("", "0"):
        return None
    return recordings(name).get(host_signature())


def _small_model(c, *, d_model=32, layers=1, heads=2, kv_heads=2, mlp=64):
    c.model.d_model, c.model.num_layers = d_model, layers
    c.model.num_heads, c.model.num_kv_heads, c.model.mlp_dim = heads, kv_heads, mlp


def _reduce(c, *, num_tasks=4, group_size=4):
    """Few steps of a small batch; every step logged, evaluation at step 2."""
    c.train_steps = STEPS
    c.log_every = 1
    c.sample_every = 2
    c.checkpoint_every = 100
    if c.algorithm != "ppo_vector":
        c.rollout.num_tasks, c.rollout.group_size = num_tasks, group_size
        _small_model(c, kv_heads=c.model.num_kv_heads if c.model.num_kv_heads < 2 else 2)
        # A short behaviour-cloning warm start, so that groups disagree and the
        # advantage, filter and loss paths see non-zero signals.
        c.warm_start.sft_steps, c.warm_start.sft_batch, c.warm_start.sft_lr = 40, 16, 1e-2
    return c


def _shipped(name):
    return importlib.import_module(f"configs.{name}").get_config()


def grpo_bandit():
    return _reduce(_shipped("grpo_bandit"))


def grpo_calculator():
    return _reduce(_shipped("grpo_calculator"))


def grpo_guess_number():
    return _reduce(_shipped("grpo_guess_number"))


def llama_calculator():
    return _reduce(_shipped("llama_calculator"))


def ppo_guess_number():
    return _reduce(_shipped("ppo_guess_number"), num_tasks=8, group_size=1)


def vineppo_guess_number():
    return _reduce(_shipped("vineppo_guess_number"), num_tasks=2, group_size=4)


def erpo_mixture():
    return _reduce(_shipped("erpo_mixture"), num_tasks=6, group_size=2)


def ppo_cartpole():
    c = _reduce(_shipped("ppo_cartpole"))
    c.sample_every = 0  # as shipped: vector envs have no transcripts
    c.vector.num_envs, c.vector.num_steps = 4, 16
    c.updates.minibatches, c.updates.epochs = 2, 2
    return c


# Feature variants: code paths of the token trainer that no shipped config exercises.
def grpo_lora_kl_sharded():
    """LoRA adapters, a k3 KL term to the base, StarPO-S, a 2x2x2 mesh, dual clip."""
    c = _reduce(_shipped("grpo_bandit"), num_tasks=4, group_size=4)
    c.model.lora_rank, c.model.lora_targets = 4, ("q_proj", "v_proj", "down_proj")
    c.loss.kl_coef, c.loss.kl_kind = 0.05, "k3"
    c.loss.dual_clip = 3.0
    c.filters.starpo_keep_fraction = 0.5
    c.mesh = (2, 2, 2)
    return c


def ppo_process_rewards():
    """Critic PPO with env process rewards, a learned PRM on Monte Carlo labels, PRIME's
    implicit PRM, KL in the reward, ECHO, entropy, Dr.GRPO-style aggregation."""
    c = _reduce(_shipped("ppo_guess_number"), num_tasks=4, group_size=2)
    c.env.kwargs.max_turns = 3
    c.process.reward_weight = 0.5
    c.process.mc_samples = 2
    c.process.branch_turns = (1,)
    c.process.mc_estimate = "soft"
    c.process.train_prm = True
    c.process.prm_weight = 0.5
    c.process.implicit_coef = 0.05
    c.loss.kl_coef, c.loss.kl_in_reward = 0.02, True
    c.loss.echo_coef = 0.05
    c.loss.entropy_coef = 0.01
    c.loss.value_clip = 0.2
    c.loss.agg = "seq-mean-token-sum-norm"
    return c


def rloo_dataset_dapo():
    """RLOO with DAPO's zero-variance filter, a chunked log-prob forward, a cosine
    schedule with warmup and weight decay, and SFT on a stored demonstration set."""
    c = _reduce(_shipped("grpo_bandit"), num_tasks=4, group_size=4)
    c.algorithm = "rloo"
    c.filters.dapo_zero_variance = True
    c.model.logprob_chunk = 8
    c.optim.schedule, c.optim.warmup_steps, c.optim.weight_decay = "cosine", 1, 0.01
    c.loss.sft_dataset = "<demonstrations>"  # built per run, see run_case
    return c


def reinforce_pp_whiten_turns():
    """REINFORCE++ and Dr.GRPO rows of the table through a horizon curriculum, the
    frozen lake env, top-k/top-p sampling and a bf16 activation dtype."""
    c = _reduce(_shipped("grpo_bandit"), num_tasks=4, group_size=4)
    c.algorithm = "reinforce_pp"
    c.env.name = "frozen_lake"
    c.env.params = {}
    c.rollout.horizon_rounds, c.rollout.horizon_every = (2, 4), 2
    c.rollout.top_k, c.rollout.top_p = 8, 0.9
    c.model.dtype = "bfloat16"
    c.updates.minibatches = 2
    return c


def drgrpo_guess_number():
    c = _reduce(_shipped("grpo_guess_number"), num_tasks=4, group_size=4)
    c.algorithm = "drgrpo"
    c.loss.agg = "seq-mean-token-sum"
    c.loss.clip_high = 0.28
    return c


def ppo_clipping():
    """Critic PPO whose clips bind: two epochs of two minibatches at a high learning rate
    move the policy and the critic off the rollout's within each update, past narrow
    policy clips (both sides), a dual clip and a value clip; an entropy bonus."""
    c = _reduce(_shipped("ppo_guess_number"), num_tasks=8, group_size=1)
    c.updates.epochs, c.updates.minibatches = 2, 2
    c.optim.learning_rate = 5e-3
    c.loss.clip_low, c.loss.clip_high, c.loss.dual_clip = 0.02, 0.01, 1.03
    c.loss.value_clip = 0.02
    c.loss.entropy_coef = 0.01
    return c


def ppo_guess_number_bfloat16():
    """Critic PPO as accelerator users run it: bfloat16 parameters and activations with
    float32 master weights (`arl.optim.float32_master_weights`), a k3 KL term to the
    bfloat16 reference, an entropy bonus; every statistic (log-probs, entropy, KL,
    values, GAE, losses, norms) in float32."""
    c = _reduce(_shipped("ppo_guess_number"), num_tasks=8, group_size=1)
    c.model.dtype = c.model.param_dtype = "bfloat16"
    c.loss.kl_coef, c.loss.kl_kind = 0.05, "k3"
    c.loss.entropy_coef = 0.01
    return c


CASES = {f.__name__: f for f in (
    grpo_bandit, grpo_calculator, grpo_guess_number, llama_calculator, ppo_guess_number,
    vineppo_guess_number, erpo_mixture, ppo_cartpole, grpo_lora_kl_sharded,
    ppo_process_rewards, rloo_dataset_dapo, reinforce_pp_whiten_turns, drgrpo_guess_number,
    ppo_clipping, ppo_guess_number_bfloat16)}


@contextlib.contextmanager
def perturbed_rounding():
    """Within: every non-zero floating initial parameter (every `flax.linen.Module.init`:
    the policy, the critic head, process reward models, the vector-env actor-critic)
    one ulp up in its own dtype. The run computes the same function of a rounding-sized
    different start; zeros stay zero (LoRA's B, zero-initialised heads)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    def one_ulp_up(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jnp.where(x != 0, jnp.nextafter(x, jnp.asarray(jnp.inf, x.dtype)), x)

    original = nn.Module.init

    def init(self, *args, **kwargs):
        return jax.tree.map(one_ulp_up, original(self, *args, **kwargs))

    nn.Module.init = init
    try:
        yield
    finally:
        nn.Module.init = original


def run_case(name: str, workdir: str, *, perturbed: bool = False) -> list[dict]:
    """The logged records of case `name` trained in `workdir` (a fresh directory); with
    `perturbed`, under `perturbed_rounding`."""
    from arl.rollout import episode_datasets as datasets
    from arl.runs import experiment

    config = CASES[name]()
    if config.loss.sft_dataset == "<demonstrations>":
        config.loss.sft_dataset = datasets.build_demonstrations(
            os.path.join(workdir, "data"), config.env.to_dict(), num_episodes=64,
            action_source="demonstrator")
    with perturbed_rounding() if perturbed else contextlib.nullcontext():
        records = experiment.run(config, os.path.join(workdir, "run"))
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in records]


def _relative_difference(a, b) -> float:
    """|a - b| / max(|a|, |b|) of two logged values (0 when equal, NaN and NaN included;
    inf for a change of kind, a non-number, or NaN against a number)."""
    if a == b:
        return 0.0
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    if not numbers or any(x != x for x in (a, b)):  # NaN
        return 0.0 if numbers and a != a and b != b else float("inf")
    return abs(a - b) / max(abs(a), abs(b))


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# Decisions: metrics that count episodes or tokens on one side of a boundary (a sampled
# token, an argmax, a clip), which a rounding difference flips whole or not at all: the
# statistics of a batch of episodes (`arl.trainers.credit_assignment.rollout_metrics`,
# logged for the training rollout, the greedy `eval/` and the sampled `eval_sampled/`
# evaluation, and per environment of a mixture, `reward_mean/<env>`; the vector trainer's
# `episode_return`, `episodes_finished`), and fractions of tokens or rows (clip
# fractions, `kept_fraction`, `degenerate_group_fraction`).
EPISODE_METRICS = ("reward_mean", "reward_std", "success_rate", "turns_mean",
                   "response_tokens_mean", "context_tokens_mean", "format_error_rate",
                   "episode_return", "episodes_finished")
EVALUATION_PREFIXES = ("eval/", "eval_sampled/")
UNBOUNDED = {"rtol": float("inf"), "atol": float("inf")}


def is_decision_metric(key: str) -> bool:
    for prefix in EVALUATION_PREFIXES:
        key = key.removeprefix(prefix)
    return key.split("/")[0] in EPISODE_METRICS or "fraction" in key


def _decided_otherwise(record: dict, moved: dict[str, float]) -> bool:
    """Whether at this record the perturbed run made another decision, or a clip bound
    some tokens (clipped and unclipped tokens then lie on both sides of a boundary that
    rounding moves them across)."""
    return any(moved[k] or ("clip_fraction" in k and record[k] != 0)
               for k in moved if is_decision_metric(k))


def rooms(as_is: list[dict], perturbed: list[dict]) -> list[dict[str, dict[str, float]]]:
    """Per record of `as_is`, {metric: {"rtol", "atol"}} for its numeric metrics.

    While the two runs make the same decisions: ROOM_FACTOR x the largest relative and
    absolute difference of the metric between them at this record or an earlier one
    (rounding differences grow over a run; the largest so far steadies the one-sample
    estimate), the relative room at least MIN_RTOL, so what did not move (decisions
    included) compares exactly; a continuous metric's absolute room is at least
    MIN_ATOL (a value under it says nothing), and its relative room at least
    ROOM_FACTOR x the median of the continuous metrics' largest relative differences
    so far (one metric's difference in one pair of runs can be small by chance:
    `ppo_guess_number`'s first `loss/policy` moved 60 x less under the perturbation than
    between two processors).

    From the first record where the perturbation moved a decision, or where a clip
    bound some tokens: UNBOUNDED for every metric. The runs then follow other sample
    paths (or may), where one pair's difference bounds nothing: a decision that happened
    not to flip in this pair flips on another processor (seen: the greedy evaluation of
    `ppo_guess_number_bfloat16` after its first step's episodes moved; `ppo_clipping`'s
    clip fractions and, from them, all its update's metrics, on a Zen 3, though not
    under the perturbation)."""
    out, largest, diverged, typical = [], {}, False, 0.0
    for a, p in zip(as_is, perturbed):
        numeric = [k for k in set(a) & set(p) if _is_number(a[k]) and _is_number(p[k])]
        moved = {k: _relative_difference(a[k], p[k]) for k in numeric}
        diverged = diverged or _decided_otherwise(a, moved)
        if diverged:
            out.append({key: dict(UNBOUNDED) for key in numeric})
            continue
        for key in numeric:
            absolute = abs(a[key] - p[key]) if 0.0 < moved[key] < float("inf") else moved[key]
            r, at = largest.get(key, (0.0, 0.0))
            largest[key] = (max(r, moved[key]), max(at, absolute))
        continuous = {k for k in numeric if k != "step" and not is_decision_metric(k)}
        spreads = sorted(largest[k][0] for k in continuous if a[k] != 0)
        typical = max(typical, spreads[len(spreads) // 2] if spreads else 0.0)
        out.append({key: {"rtol": max(ROOM_FACTOR * largest[key][0], MIN_RTOL,
                                      ROOM_FACTOR * typical if key in continuous else 0.0),
                          "atol": max(ROOM_FACTOR * largest[key][1],
                                      MIN_ATOL if key in continuous else 0.0)}
                    for key in numeric})
    return out


def says_nothing(want, room: dict[str, float]) -> bool:
    """Whether a room bounds nothing about `want`: it spans the value itself."""
    return room["rtol"] >= 1.0 or 0.0 < abs(want) <= room["atol"]


def close(want, got, room: dict[str, float] | None) -> bool:
    """Whether `got` is `want` (room None: bit for bit), or within the room's relative
    or absolute part."""
    relative = _relative_difference(want, got)
    if relative == 0.0:
        return True
    if room is None or relative == float("inf"):
        return False
    return relative <= room["rtol"] or abs(want - got) <= room["atol"]


def _print_rooms(names):
    """Both runs of each case here and the rooms the test would compare with."""
    for name in names:
        with tempfile.TemporaryDirectory() as workdir:
            as_is = run_case(name, os.path.join(workdir, "a"))
            perturbed = run_case(name, os.path.join(workdir, "b"), perturbed=True)
        for record, room in zip(as_is, rooms(as_is, perturbed)):
            for key in sorted(room):
                flag = " (says nothing)" if says_nothing(record[key], room[key]) else ""
                print(f"{name} step {record['step']} {key}: {record[key]!r}, "
                      f"rtol {room[key]['rtol']:.3g} atol {room[key]['atol']:.3g}{flag}")


def _record(names, *, keep_other_processors: bool):
    signature = host_signature()
    directory = processors().get(signature) or os.path.join(
        GOLDEN_DIR, processor_dir_name(signature))
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, HOST_FILE), "w", encoding="utf-8") as f:
        json.dump({"host": signature}, f, indent=1)
    for name in names:
        with tempfile.TemporaryDirectory() as workdir:
            records = run_case(name, workdir)
        with open(os.path.join(directory, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1, sort_keys=True)
        if not keep_other_processors:
            for other, other_dir in processors().items():
                stale = os.path.join(other_dir, f"{name}.json")
                if other != signature and os.path.isfile(stale):
                    os.remove(stale)
        print(f"recorded {name}: {len(records)} records, {len(records[0])} metrics")
    for other_dir in processors().values():  # a processor left without recordings
        if os.listdir(other_dir) == [HOST_FILE]:
            shutil.rmtree(other_dir)


if __name__ == "__main__":
    args = sys.argv[1:]
    commands = ("--record", "--add-processor", "--rooms")
    if not args or args[0] not in commands:
        sys.exit(__doc__)
    unknown = sorted(set(args[1:]) - set(CASES))
    if unknown:
        sys.exit(f"unknown cases {unknown}; the cases are {sorted(CASES)}")
    if args[0] == "--rooms":
        _print_rooms(args[1:] or list(CASES))
        sys.exit(0)
    _record(args[1:] or list(CASES), keep_other_processors=args[0] == "--add-processor")
