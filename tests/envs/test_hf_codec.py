"""HFCodec over a BPE tokenizer trained on the fly: codec contract, chat formatting, and
the calculator / guess_number environments running on its subword ids (oracle 100%)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from arl.envs.tasks import calculator, guess_number  # noqa: E402
from arl.envs.base import TokenChunk  # noqa: E402
from arl.text.hf_codec import HFCodec, train_bpe_tokenizer  # noqa: E402

BATCH = 64


def env_corpus():
    rng = np.random.default_rng(0)
    lines = [f"guess 0-{n - 1}" for n in (8, 16, 100)] + list(guess_number.REPLIES)
    lines += list(calculator.REPLIES)
    for _ in range(200):
        a, b = rng.integers(-99, 100, 2)
        op = "+-*"[rng.integers(3)]
        lines += [f"<calc>{a}{op}{b}</calc>", f"<answer>{a}</answer>", f"{a}{op}{b}"]
    return lines


TOKENIZER = train_bpe_tokenizer(env_corpus(), vocab_size=300)
CODEC = HFCodec(TOKENIZER)


def test_codec_contract_and_round_trip():
    assert CODEC.vocab_size == 300 and CODEC.pad_id == 0
    assert [CODEC.decode([i]) for i in CODEC.digit_ids] == list("0123456789")
    assert CODEC.digit_value[CODEC.digit_ids].tolist() == list(range(10))
    assert (CODEC.digit_value >= 0).sum() == 10
    for text in ["<calc>47*86</calc>", "guess 0-15", "bad expression", "<answer>-12</answer>"]:
        ids = CODEC.encode(text)
        assert CODEC.decode(ids) == text
    # Subword merges really happen (fewer ids than characters) ...
    assert len(CODEC.encode("bad expression")) < len("bad expression")
    # ... while tags keep one id per punctuation mark in any context.
    tag = CODEC.encode("<calc>")
    assert CODEC.encode("<calc>-5*7</calc>")[:len(tag)] == tag
    ids, n = CODEC.encode_padded("7<eot>", 4)
    assert ids.tolist() == [CODEC.digit_ids[7], CODEC.eot_id, 0, 0] and n == 2
    assert CODEC.decode([CODEC.digit_ids[1], 0, CODEC.digit_ids[2]]) == "1"
    assert CODEC.decode([CODEC.digit_ids[1], 0, CODEC.digit_ids[2]], stop_at_pad=False) == "12"
    assert CODEC.decode([CODEC.eot_id, 999], show_special=False) == "<?>"


def test_chat_formatting():
    ids = CODEC.chat_ids([{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "2+2"}])
    assert ids[0] == CODEC.bos_id and ids[-1] == CODEC.role_ids["assistant"]
    assert CODEC.decode(ids) == "<bos><system>be brief<eot><user>2+2<eot><agent>"
    assert CODEC.decode(ids, show_special=False) == "be brief2+2"
    with pytest.raises(ValueError, match="role"):
        CODEC.chat_ids([{"role": "tool", "content": "x"}])


def test_codec_rejects_tokenizers_the_envs_cannot_parse(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    merged = Tokenizer(models.BPE())
    merged.pre_tokenizer = pre_tokenizers.Whitespace()  # keeps "12" together
    merged.train_from_iterator(["12 12 12 34 34 5 6 7 8 9 0 - + * < > /"] * 20,
                               trainers.BpeTrainer(vocab_size=60, special_tokens=[
                                   "<pad>", "<bos>", "<eot>", "<system>", "<user>", "<agent>"],
                                   show_progress=False))
    # Every single digit is one token, but "1234567" is written "12" "34" "5" ...: no
    # rule of runs from the left writes numbers that way inside jit.
    with pytest.raises(ValueError, match=r"writes the number 1234567 as \['12', '34'"):
        HFCodec(merged)
    with pytest.raises(ValueError, match="pad_token"):
        HFCodec(TOKENIZER, pad_token="<nope>")
    path = tmp_path / "tokenizer.json"
    TOKENIZER.save(str(path))
    assert HFCodec(str(path)).encode("<calc>1+2</calc>") == CODEC.encode("<calc>1+2</calc>")
    with pytest.raises(TypeError, match="tokenizer"):
        HFCodec(42)


@functools.lru_cache(maxsize=None)
def _compiled(env):
    """Jitted, vmapped reset / step / oracle of `env` (one compile per env per module)."""
    return (jax.jit(jax.vmap(env.reset, in_axes=(0, None))),
            jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None))),
            jax.jit(jax.vmap(env.oracle_action, in_axes=(0, 0, None))))


GUESS = guess_number.GuessNumber(CODEC, max_n=16)
CALC = calculator.Calculator(CODEC, max_digits=2)


def _oracle_rollout(env, key):
    reset, step, oracle = _compiled(env)
    params = env.default_params()
    key, key_reset = jax.random.split(key)
    state, first = reset(jax.random.split(key_reset, BATCH), params)
    errors = []
    for _ in range(env.max_turns):
        key, key_act, key_step = jax.random.split(key, 3)
        action = oracle(jax.random.split(key_act, BATCH), state, params)
        state, ts = step(jax.random.split(key_step, BATCH), state, action, params)
        errors.append(ts.info["format_error"])
    return first, state, jnp.stack(errors)


@pytest.mark.parametrize("env", [GUESS, CALC], ids=["guess_number", "calculator"])
def test_oracle_solves_env_on_bpe_ids(env):
    first, state, errors = _oracle_rollout(env, jax.random.key(3))
    assert bool(jnp.all(state.success)) and not bool(jnp.any(errors))
    prompt = CODEC.decode(first.observation.tokens[0])
    if env.name == "guess_number":
        assert prompt == "guess 0-15"
        assert env.prompt_len == len(CODEC.encode("guess 0-")) + 2
    else:
        assert prompt.replace("-", "+").replace("*", "+").count("+") >= 1


def test_calculator_parses_bpe_spelled_turns_inside_jit():
    env = CALC
    params = env.default_params()
    state, _ = env.reset(jax.random.key(0), params)
    state = state.replace(left=jnp.asarray(47), right=jnp.asarray(86), operator=jnp.asarray(2),
                          answer=jnp.asarray(4042))
    cases = [("<calc>47*86</calc><eot>", "4042", False),
             ("<calc>-5-7</calc>", "-12", False),
             ("<calc>4*</calc>", "bad expression", True),
             ("<x>4+5</x>", "unknown tool", True),
             ("4042", "invalid", True),
             ("<answer>4041</answer>", "wrong", False),
             ("<answer>4042</answer><eot>", "correct", False)]
    # Padded to the oracle's batch and action width so the compiled step is reused.
    rows = [CODEC.encode_padded(text, env.action_len) for text, _, _ in cases]
    rows += [rows[-1]] * (BATCH - len(rows))
    actions = TokenChunk(jnp.asarray(np.stack([r[0] for r in rows])),
                         jnp.asarray([r[1] for r in rows], jnp.int32))
    states = jax.tree.map(lambda x: jnp.broadcast_to(x, (BATCH,) + x.shape), state)
    _, step, _ = _compiled(env)
    _, ts = step(jax.random.split(jax.random.key(1), BATCH), states, actions, params)
    for i, (text, reply, error) in enumerate(cases):
        assert CODEC.decode(ts.observation.tokens[i]) == reply, text
        assert bool(ts.info["format_error"][i]) == error, text
    assert bool(ts.info["success"][len(cases) - 1])


def test_llama_calculator_config_builds_an_hf_codec_env():
    import importlib

    from arl import config as config_lib
    from arl.envs import make

    config = importlib.import_module("configs.llama_calculator").get_config()
    config_lib.validate(config, num_devices=1)
    assert set(config.keys()) == set(config_lib.default_config().keys())
    env = make(config.env.name, **dict(config.env.kwargs))
    assert isinstance(env.codec, HFCodec) and env.codec.vocab_size == 320
    assert env.codec.decode(env.codec.encode("<calc>3*4</calc>")) == "<calc>3*4</calc>"
    # Budgets are counted in BPE ids: "answer" is one id, so fewer than the 21 characters
    # of "<answer>-81</answer><eot>"-sized turns.
    assert env.action_len < len("<answer>") + 3 + len("</answer>") + 1


@pytest.mark.slow
def test_llama_calculator_trains_end_to_end(tmp_path):
    """Two compiled GRPO + SFT steps of the shipped config on CPU: finite metrics."""
    import importlib

    from arl.runs import experiment

    config = importlib.import_module("configs.llama_calculator").get_config()
    config.train_steps, config.log_every, config.sample_every = 2, 1, 2
    config.warm_start.sft_steps = 2
    config.checkpoint_every = 2
    config.rollout.num_tasks, config.rollout.group_size = 4, 4
    records = experiment.run(config, str(tmp_path))
    assert [r["step"] for r in records][-1] == 2
    assert all(np.isfinite(v) for r in records for v in r.values()
               if isinstance(v, float))


@pytest.mark.parametrize("name", ["bandit", "frozen_lake"])
def test_every_other_builtin_env_runs_on_bpe_ids(name):
    """bandit and frozen_lake on a BPE trained on `configs.tokenizer_corpus.env_corpus`: the
    oracle solves every task with no format error (budgets counted in subword ids)."""
    from arl import rollout as rollout_lib
    from arl.envs import make
    from configs.tokenizer_corpus import env_corpus as arl_env_corpus

    codec = HFCodec(train_bpe_tokenizer(arl_env_corpus(), vocab_size=320))
    env = make(name, codec=codec)
    traj = rollout_lib.scripted_rollout(env, jax.random.key(0), num_tasks=32, group_size=1)
    assert bool(jnp.all(traj.success)), rollout_lib.render_trajectory(env, traj, 0)
    assert int(traj.format_errors.sum()) == 0
