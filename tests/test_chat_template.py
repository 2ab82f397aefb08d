"""A checkpoint directory's tokenizer and chat template in the rollout: the tokens the
policy reads before every turn of a multi-turn episode equal `transformers`'
`apply_chat_template` of the same conversation (Qwen2.5-, Qwen3- and Llama-3-style
stand-ins), turns end on the model's own end-of-turn token, no BOS where the model has
none; templates whose turns cannot be cut into static pieces are refused."""

import functools
import json

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from arl import rollout as rollout_lib  # noqa: E402
from arl.text import chat_template  # noqa: E402
from arl.envs.tasks.dataset_task import DatasetTask  # noqa: E402
from arl.text.hf_codec import HFCodec  # noqa: E402
from tests.hf_standins import build_standin  # noqa: E402

ROWS = [(1, 2), (30, 12), (7, 8), (100, 5), (3, 3), (9, 9), (11, 4), (5, 60), (2, 2), (4, 4)]
SYSTEM = "Answer with a number."


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {a} plus {b}?",
                                        "answer": str(a + b)}) + "\n" for a, b in ROWS))
    return str(path)


@functools.lru_cache(maxsize=None)
def _standin(root, family):
    return build_standin(f"{root}/{family}", family)


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    root = tmp_path_factory.mktemp("standins")
    return lambda family: _standin(str(root), family)


def _reply(reward, turn, max_turns):
    if reward > 0:
        return "correct"
    return "wrong, try again" if turn + 1 < max_turns else "wrong"


@pytest.mark.parametrize("family,system,kwargs,max_turns", [
    ("qwen2", None, {}, 3), ("qwen2", SYSTEM, {}, 3),
    # Qwen3 rewrites earlier turns: one turn here, thinking on and off (more turns read its
    # keep-history variant: tests/test_history_modes.py).
    ("qwen3", SYSTEM, {}, 1), ("qwen3", SYSTEM, {"enable_thinking": False}, 1),
    ("llama3", SYSTEM, {}, 3), ("llama3.1", SYSTEM, {}, 3)])
def test_policy_reads_apply_chat_template_every_turn(standins, jsonl, family, system, kwargs,
                                                     max_turns):
    from transformers import AutoTokenizer

    directory = standins(family)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    codec = HFCodec.from_pretrained(directory, system_prompt=system, template_kwargs=kwargs)
    eot = "<|eot_id|>" if family.startswith("llama") else "<|im_end|>"
    assert codec.eot_id == tokenizer.convert_tokens_to_ids(eot)
    assert (codec.bos_id is None) == (not family.startswith("llama"))
    if family == "llama3.1":  # Llama 3's merged digits: "100" is one token
        assert codec.digit_group == 3 and len(tokenizer.encode("100")) == 2  # BOS + "100"
    env = DatasetTask(jsonl, codec=codec, max_turns=max_turns)
    keys, params = env.split_tasks(group_size=2)
    params = params.replace(demonstrator_accuracy=params.demonstrator_accuracy * 0 + 0.4)
    play = jax.jit(functools.partial(rollout_lib.rollout, env, num_tasks=env.num_rows,
                                     group_size=2, action_source="demonstrator"))
    traj = jax.device_get(play(jax.random.key(1), reset_keys=keys, env_params=params))
    turns_seen = set()
    for b in range(2 * env.num_rows):
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": env.tasks.prompt_texts[b // 2]})
        tokens = traj.tokens[b]
        for t in range(int(traj.num_turns[b])):
            start = int(traj.turn_starts[b, t])
            expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, **kwargs)
            expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
            assert tokens[:start].tolist() == expected, (family, b, t)
            if codec.bos_id is None:
                assert codec.bos_id not in tokens[:start].tolist()
            agent = np.flatnonzero(traj.agent_mask[b, start:] > 0)
            end = start + int(np.flatnonzero(np.diff(agent) != 1)[0] + 1 if
                              np.any(np.diff(agent) != 1) else agent.size)
            action = tokens[start:end].tolist()
            assert action[-1] == codec.eot_id  # the turn ends on the model's own token
            messages.append({"role": "assistant",
                             "content": tokenizer.decode(action[:-1])})
            messages.append({"role": "user", "content": _reply(
                float(traj.turn_rewards[b, t]), t, max_turns)})
            turns_seen.add(t)
    assert turns_seen == set(range(max_turns))  # every turn was checked


def test_stop_ids_are_the_templates_eot_and_every_eos_of_generation_config(standins):
    """As generate() does: Qwen stops on <|im_end|> and <|endoftext|>, Llama 3.1 on
    <|eot_id|>, <|end_of_text|> and <|eom_id|>; a turn ended by any of them ends there."""
    import jax.numpy as jnp

    from arl.envs.base import TokenChunk
    from arl.text.codec import stop_ids
    from arl.envs.tasks.guess_number import GuessNumber

    qwen = HFCodec.from_pretrained(standins("qwen2"))
    names = lambda codec: [codec.tokenizer.id_to_token(i) for i in stop_ids(codec)]
    assert names(qwen) == ["<|im_end|>", "<|endoftext|>"]
    llama = HFCodec.from_pretrained(standins("llama3.1"))
    assert names(llama) == ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"]
    env = GuessNumber(codec=qwen, max_n=16)
    params = env.default_params()
    state, _ = env.reset(jax.random.key(0), params)
    state = state.replace(hidden=jnp.asarray(7))
    end = qwen.tokenizer.token_to_id("<|endoftext|>")
    for ids, reply in [(qwen.encode("7") + [end] + qwen.encode("9"), "correct"),
                       (qwen.encode("79"), "invalid")]:
        _, ts = env.step(jax.random.key(1), state, TokenChunk(
            jnp.asarray(ids + [qwen.pad_id] * 2, jnp.int32), jnp.asarray(len(ids))), params)
        assert env.render_chunk(ts.observation) == reply, ids


def test_a_cut_action_is_closed_by_the_eot_in_the_reply(standins):
    codec = HFCodec.from_pretrained(standins("qwen2"))
    chat = codec.chat
    reply = chat_template.TokenChunk(np.asarray(codec.encode("wrong") + [codec.pad_id] * 3,
                                                np.int32), np.int32(len(codec.encode("wrong"))))
    closed = jax.device_get(chat.wrap_reply(reply, True))
    cut = jax.device_get(chat.wrap_reply(reply, False))
    body = list(chat.reply_prefix) + codec.encode("wrong") + list(chat.turn_suffix)
    assert closed.tokens[:closed.length].tolist() == body
    assert cut.tokens[:cut.length].tolist() == [codec.eot_id] + body
    assert set(cut.tokens[cut.length:].tolist()) <= {codec.pad_id}


def _derive(codec, template):
    specials = [t.content for t in codec.tokenizer.get_added_tokens_decoder().values()]
    return chat_template.derive_chat_format(
        template, encode=codec.encode, special_texts=specials, special_tokens={},
        pad_id=codec.pad_id)


@pytest.mark.parametrize("template,message", [
    # contents rewritten
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n"
     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
     "rewrites message contents"),
    # an assistant turn ends without a special token
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
     "{% if add_generation_prompt %}assistant: {% endif %}", "one special token"),
])
def test_templates_that_cannot_be_split_are_refused(standins, template, message):
    codec = HFCodec.from_pretrained(standins("qwen2"))
    with pytest.raises(chat_template.ChatTemplateError, match=message):
        _derive(codec, template)


def test_templates_whose_later_turns_depend_on_position_serve_one_turn_only(standins):
    codec = HFCodec.from_pretrained(standins("qwen2"))
    chat = _derive(codec, "{% for m in messages %}<|im_start|>{{ m.role }} {{ loop.index }}\n"
                          "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt "
                          "%}<|im_start|>assistant\n{% endif %}")
    assert "renders an earlier assistant turn's opening as" in chat.multi_turn_error
    chat.check_turns(1)
    with pytest.raises(chat_template.ChatTemplateError, match="max_turns=2"):
        chat.check_turns(2)


def test_codec_of_a_directory_without_bos_or_pad(standins, tmp_path):
    codec = HFCodec.from_pretrained(standins("llama3"))
    # Llama 3 names no pad token: a spare special token pads, never one the turns use.
    used = set(codec.chat.prompt_prefix + codec.chat.turn_suffix + codec.chat.reply_prefix)
    assert codec.pad_id not in used | {codec.eot_id, codec.bos_id}
    assert codec.chat.prompt_prefix[0] == codec.bos_id
    qwen = HFCodec.from_pretrained(standins("qwen2"))
    assert qwen.bos_id is None and qwen.chat.prompt_prefix[0] != qwen.pad_id


def test_padded_vocabulary_ids_are_never_sampled_nor_scored():
    """A model vocabulary padded past the tokenizer's (token_vocab_size): the padded ids'
    logits are masked even when the head prefers them, sampling never returns them, and
    the chunked log-probs (cut matrix) equal the masked logits' log-softmax."""
    import flax.linen as nn
    import jax.numpy as jnp

    from arl.models import sampling
    from arl.models.chunked_logprobs import chunked_token_logprobs
    from arl.models.transformer import Transformer, TransformerConfig, output_matrix

    config = TransformerConfig(vocab_size=64, d_model=16, num_layers=1, num_heads=2,
                               num_kv_heads=2, mlp_dim=32, max_len=16, token_vocab_size=40)
    model = Transformer(config)
    tokens = jnp.asarray([[1, 5, 9, 3, 7, 2]])
    params = dict(nn.unbox(model.init(jax.random.key(0), tokens)["params"]))
    hidden = model.apply({"params": params}, tokens, return_hidden=True,
                         compute_logits=False).hidden
    # Make the head prefer the padded ids at the last position (unmasked argmax >= 40).
    params["lm_head"] = params["lm_head"].at[:, 40:].set(5.0 * hidden[0, -1][:, None])
    assert int(jnp.argmax(hidden[0, -1] @ params["lm_head"])) >= 40
    logits = model.apply({"params": params}, tokens).logits
    assert float(jnp.max(logits[..., 40:])) < -1e29
    samples, _ = sampling.sample_from_logits(
        jax.random.key(1), jnp.broadcast_to(logits[0, -1], (2000, 64)))
    assert int(jnp.max(samples)) < 40 and len(set(np.asarray(samples).tolist())) > 20
    matrix, vocab_major = output_matrix(params, config)
    assert matrix.shape == (16, 40)
    logp, entropy = chunked_token_logprobs(hidden[:, :-1], matrix, tokens[:, 1:], 2, 1.0,
                                           vocab_major=vocab_major)
    reference = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    np.testing.assert_allclose(
        logp, jnp.take_along_axis(reference, tokens[:, 1:, None], -1)[..., 0], atol=1e-5)
    assert np.all(np.isfinite(entropy))


@pytest.mark.parametrize("name,kwargs", [("guess_number", {"max_n": 16}),
                                         ("calculator", {}), ("frozen_lake", {})])
def test_games_and_tools_are_wrapped_in_the_template_too(standins, name, kwargs):
    """Every token env goes through the same wrapping: the oracle's episodes of a game
    and a tool env read, before every turn, `apply_chat_template` of the conversation
    their decoded turns make."""
    from transformers import AutoTokenizer

    from arl import envs

    directory = standins("qwen2")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    codec = HFCodec.from_pretrained(directory, system_prompt=SYSTEM)
    env = envs.make(name, codec=codec, **kwargs)
    traj = jax.device_get(rollout_lib.scripted_rollout(env, jax.random.key(2), num_tasks=4,
                                                       group_size=1, action_source="oracle"))
    checked = 0
    for b in range(4):
        tokens, observed = traj.tokens[b], traj.observation_mask[b] > 0
        starts = [int(traj.turn_starts[b, t]) for t in range(int(traj.num_turns[b]))]
        prefix = list(codec.chat.prompt_prefix)
        first = len(prefix)
        end_first = starts[0] - len(codec.chat.turn_suffix)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": tokenizer.decode(tokens[first:end_first])}]
        for t, start in enumerate(starts):
            expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True)
            expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
            assert tokens[:start].tolist() == expected, (name, b, t)
            checked += 1
            agent_end = start
            while agent_end < len(tokens) and traj.agent_mask[b, agent_end] > 0:
                agent_end += 1
            assert tokens[agent_end - 1] == codec.eot_id
            messages.append({"role": "assistant",
                             "content": tokenizer.decode(tokens[start:agent_end - 1])})
            reply_start = agent_end + len(codec.chat.reply_prefix)
            reply_end = reply_start
            while observed[reply_end] and tokens[reply_end] != codec.eot_id:
                reply_end += 1
            messages.append({"role": "user",
                             "content": tokenizer.decode(tokens[reply_start:reply_end])})
    assert checked >= 4


def test_the_checkpoint_is_the_token_envs_codec_unless_one_is_named(standins, jsonl):
    from arl import config as config_lib
    from arl import envs
    from arl.errors import ConfigError

    directory = standins("qwen2")
    c = config_lib.default_config()
    c.model.hf_checkpoint = directory
    c.model.system_prompt = SYSTEM
    c.env.name, c.env.kwargs = "dataset_task", {"path": jsonl}
    env = envs.make_env(c.env, codec=envs.checkpoint_codec(c))
    assert env.codec.directory == directory and env.codec.chat.system_prompt == SYSTEM
    assert rollout_lib.first_observation_length(env) == (
        len(env.codec.chat.prompt_prefix) + env.prompt_len + len(env.codec.chat.turn_suffix))
    mixture = envs.make_env({"name": "mixture", "members": [
        {"name": "guess_number"}, {"name": "calculator"}]}, codec=envs.checkpoint_codec(c))
    assert all(m.codec is env.codec for m in mixture.envs)
    # An explicit codec wins: a bare tokenizer.json keeps arl's plain turns.
    from configs.tokenizer_corpus import env_corpus
    from arl.text.hf_codec import train_bpe_tokenizer
    own = str(standins("qwen2")) + "-own-tokenizer.json"
    train_bpe_tokenizer(env_corpus(), vocab_size=300).save(own)
    c.env.name, c.env.kwargs = "guess_number", {"codec": own}
    explicit = envs.make_env(c.env, codec=envs.checkpoint_codec(c))
    assert explicit.codec.chat is None and explicit.codec.bos_id is not None
    # A directory the template cannot be read from is a one-line ConfigError.
    broken = str(standins("qwen2")) + "-broken"
    import shutil
    shutil.copytree(directory, broken)
    with open(f"{broken}/tokenizer_config.json", "w") as f:
        f.write('{"eos_token": "<|nope|>"}')
    c.model.hf_checkpoint = broken
    with pytest.raises(ConfigError, match=r"model.hf_checkpoint=.*eos_token='<\|nope\|>' is "
                                          r"not a token"):
        envs.checkpoint_codec(c)


def test_the_rollout_stops_a_turn_on_every_stop_id(standins):
    """With every id but the eot declared a stop id, each sampled turn is one token: the
    rollout's decoding stops on the codec's stop ids, not on the eot alone; a turn ended
    by another stop id is closed by the template's eot in front of the reply."""
    import flax.linen as nn
    import jax.numpy as jnp

    from arl.envs.tasks.guess_number import GuessNumber
    from arl.models.transformer import Transformer, TransformerConfig

    codec = HFCodec.from_pretrained(standins("qwen2"))
    codec.stop_ids = tuple(i for i in range(codec.vocab_size))  # eot first via stop_ids()
    env = GuessNumber(codec=codec, max_n=16, max_turns=2)
    config = TransformerConfig(vocab_size=codec.vocab_size, d_model=16, num_layers=1,
                               num_heads=2, num_kv_heads=2, mlp_dim=32, max_len=128)
    model = Transformer(config)
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    traj = jax.device_get(rollout_lib.rollout(env, jax.random.key(1), num_tasks=8,
                                              group_size=1, model=model, params=params))
    for b in range(8):
        agent = np.flatnonzero(traj.agent_mask[b] > 0)
        assert len(agent) == int(traj.num_turns[b]) == 2
        first = int(agent[0])
        if traj.tokens[b, first] != codec.eot_id:  # closed by the eot the reply starts with
            assert traj.tokens[b, first + 1] == codec.eot_id


def test_chat_template_kwargs_must_be_json_values():
    import ml_collections

    import arl
    from arl.errors import ConfigError

    config = arl.default_config()
    config.model.chat_template_kwargs = ml_collections.ConfigDict(
        {"enable_thinking": False, "tools": [{"type": "function",
                                              "function": {"name": "python"}}]})
    arl.validate(config)
    config.model.chat_template_kwargs = ml_collections.ConfigDict({"when": {1, 2}})
    with pytest.raises(ConfigError, match=r"config.model.chat_template_kwargs=\{'when': "
                                          r"\{1, 2\}\} is invalid: must be a dict of JSON") as e:
        arl.validate(config)
    assert "\n" not in str(e.value)
