"""Golden runs: the metrics of the first steps of every shipped config, at reduced sizes.

A refactor changes structure, not numbers. `tests/test_golden_run.py` runs each case
below through the real experiment loop (`arl.runs.experiment.run`: warm start, train steps, greedy
and sampled evaluation) and compares every logged metric with the values recorded in
`tests/golden/<case>.json`, bit for bit.

Record again only when a change is MEANT to change numbers, and say so in the commit
message: a semantic fix, or a faster computation of the same function that rounds
differently (e.g. a hand-written backward pass), which then comes with a test of the new
path against the previous one at float tolerance. The numbers belong to one JAX/XLA
build: the test extra of setup.py pins the JAX they were recorded with.

    python -m tests.golden_run --record            # every case
    python -m tests.golden_run --record grpo_bandit

Recording uses the test suite's XLA flags (tests/xla_flags.py), so the numbers are those
the tests compute.

The last bits also belong to the CPU: XLA compiles for the host's processor and its
matmul library picks kernels and blocking by it, so two x86 machines with the same JAX
round some metrics differently (seen: relative 1e-5 to 3e-3 on near-cancelling KL
estimates and losses between two AMD EPYC generations). `tests/golden/recorded_on.json`
names the processor the goldens were recorded on (`host_signature`). On that processor
the test compares bit for bit; on another it compares to `CROSS_HOST_RTOL` /
`CROSS_HOST_ATOL` and says so: rounding passes, a changed computation still fails.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile

if __name__ == "__main__":  # the same backend settings as the test suite
    from tests import xla_flags

    xla_flags.set_suite_flags()

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
RECORDED_ON = os.path.join(GOLDEN_DIR, "recorded_on.json")
STEPS = 3
# Tolerances of the comparison on a processor other than the recording one.
CROSS_HOST_RTOL, CROSS_HOST_ATOL = 2e-2, 1e-5


def host_signature() -> str:
    """The processor as XLA:CPU's code generation sees it: vendor, family, model and
    stepping, cache size, a digest of the feature flags, and the core count."""
    import hashlib
    import platform

    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor describes them all
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return f"{platform.machine()} {platform.processor()} x{os.cpu_count()}"
    flags = hashlib.sha1(fields.get("flags", "").encode()).hexdigest()[:10]
    return (f"{fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')} stepping {fields.get('stepping', '?')}, cache "
            f"{fields.get('cache size', '?')}, flags {flags}, {os.cpu_count()} cores")


def recorded_on() -> str | None:
    """The `host_signature` of the machine the goldens were recorded on (None: unknown)."""
    try:
        with open(RECORDED_ON, encoding="utf-8") as f:
            return json.load(f)["host"]
    except (OSError, KeyError, ValueError):
        return None


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


CASES = {f.__name__: f for f in (
    grpo_bandit, grpo_calculator, grpo_guess_number, llama_calculator, ppo_guess_number,
    vineppo_guess_number, erpo_mixture, ppo_cartpole, grpo_lora_kl_sharded,
    ppo_process_rewards, rloo_dataset_dapo, reinforce_pp_whiten_turns, drgrpo_guess_number)}


def run_case(name: str, workdir: str) -> list[dict]:
    """The logged records of case `name` trained in `workdir` (a fresh directory)."""
    from arl.data import datasets
    from arl.runs import experiment

    config = CASES[name]()
    if config.loss.sft_dataset == "<demonstrations>":
        config.loss.sft_dataset = datasets.build_demonstrations(
            os.path.join(workdir, "data"), config.env.to_dict(), num_episodes=64,
            action_source="demonstrator")
    records = experiment.run(config, os.path.join(workdir, "run"))
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in records]


def golden_path(name: str) -> str:
    return os.path.join(GOLDEN_DIR, f"{name}.json")


def load_golden(name: str) -> list[dict]:
    with open(golden_path(name), encoding="utf-8") as f:
        return json.load(f)


def _record(names):
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    previous = recorded_on()
    if previous is not None and previous != host_signature() and set(names) != set(CASES):
        sys.exit(f"the goldens were recorded on another processor ({previous}); record "
                 "every case again on this one (no case names), not some of them")
    with open(RECORDED_ON, "w", encoding="utf-8") as f:
        json.dump({"host": host_signature()}, f, indent=1)
    for name in names:
        with tempfile.TemporaryDirectory() as workdir:
            records = run_case(name, workdir)
        with open(golden_path(name), "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1, sort_keys=True)
        print(f"recorded {name}: {len(records)} records, {len(records[0])} metrics")


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "--record":
        sys.exit(__doc__)
    _record(args[1:] or list(CASES))
