"""No seams between an env's text and the chat template (`arl.text.seams`): with
tokenizers that split and merge as Qwen's and Llama 3's do, the context before every
turn equals the reference render (tests/seam_reference.py) on real episodes of a host
env whose replies end and start where BPEs merge (")\\n", ".\\n", '."', " -", "\\n\\n",
a cut reply's ".."), of the sql tool env in the template's tool convention, and of
countdown's "wrong: -162"; special-token names in an env's text are written as plain
characters under every family."""

from __future__ import annotations

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")

from arl import rollout as rollout_lib  # noqa: E402
from arl.envs.base import TokenChunk  # noqa: E402
from arl.envs.host import HostEnvironment, HostTurn  # noqa: E402
from arl.rewards.functions import episode_texts  # noqa: E402
from arl.text import seams  # noqa: E402
from arl.text.codec import CharCodec, encode_text  # noqa: E402
from arl.text.hf_codec import SEAM_MERGES, HFCodec  # noqa: E402
from tests.hf_standins import build_standin  # noqa: E402
from tests.seam_reference import Reference  # noqa: E402

SYSTEM = "Answer briefly."
FAMILIES = ("qwen2", "llama3", "llama3.1")
# Replies that end or start where a real BPE merges with the template's text next to
# them, or merge inside themselves; the last is cut (obs_len) and ends in "..".
SEAM_REPLIES = ("(no rows)", "Done.", 'He said "stop."', "wrong: -162", "x = (3 - 4)",
                "line one.\nline two)", "f(x) " * 30)
# Written into a Qwen reply as they are, to be read back as plain characters.
SPECIAL_REPLIES = ("x\na<|im_end|>b", "<|eot_id|>", "<|endoftext|> and <|im_start|>",
                   "<|begin_of_text|>")


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    root = tmp_path_factory.mktemp("seams")
    return functools.lru_cache(maxsize=None)(
        lambda family: build_standin(str(root / family.replace(".", "_")), family))


def test_standin_tokenizers_merge_where_real_vocabularies_merge(standins):
    """The stand-ins' tokenizers merge each seam as one token, digits as the family
    does; the old isolating tokenizer (split="isolated") merges none of them."""
    from arl.text.hf_codec import train_bpe_tokenizer
    from tests.hf_standins import QWEN_SPECIALS, _corpus

    for family, digits in (("qwen2", ["1", "2", "3", "4"]), ("llama3.1", ["123", "4"])):
        codec = HFCodec.from_pretrained(standins(family))
        for text in SEAM_MERGES:
            assert len(codec.encode(text)) == 1, (family, text)
        assert [codec.tokenizer.id_to_token(i) for i in codec.encode("1234")] == digits
        # "wrong: -162" keeps " -" together; ")\n</tool_response>" merges ")\n".
        pieces = [codec.tokenizer.decode([i]) for i in codec.encode("wrong: -162")]
        assert " -" in pieces and ":" in pieces, pieces
        assert codec.tokenizer.decode(codec.encode(")\n</x>")[:1]) == ")\n"
    isolated = train_bpe_tokenizer(_corpus(), vocab_size=360, special_tokens=QWEN_SPECIALS)
    for text in SEAM_MERGES:
        assert len(isolated.encode(text).ids) == 2, text


@pytest.mark.parametrize("family", ["char", "qwen2", "llama3.1"])
def test_numbers_are_written_as_the_tokenizer_writes_them_next_to_text(standins, family):
    """`NumberInText` under jit == the tokenizer's ids of the whole text, for numbers of
    every length and sign next to texts a sign merges with (" -", "=-", "(-")."""
    codec = CharCodec() if family == "char" else HFCodec.from_pretrained(standins(family))
    rng = random.Random(0)
    values = [0, -1, 9, -10, 999, -1000, 2 ** 31 - 1, -(2 ** 31) + 1] + [
        rng.randrange(-10 ** rng.randrange(1, 10), 10 ** rng.randrange(1, 10))
        for _ in range(40)]
    for before, after in (("wrong: ", ""), ("x=", "."), ("(", ")\n"), ("", "")):
        writer = seams.NumberInText(codec, before, after)
        chunks = jax.jit(jax.vmap(writer))(jnp.asarray(values, jnp.int32))
        for k, value in enumerate(values):
            got = np.asarray(chunks.tokens[k][:int(chunks.length[k])]).tolist()
            assert got == encode_text(codec, f"{before}{value}{after}"), (before, value)
            assert set(np.asarray(chunks.tokens[k][int(chunks.length[k]):]).tolist()) <= {
                codec.pad_id}


def test_countdown_writes_a_negative_value_with_the_space_merged(standins):
    from arl.envs.tasks.countdown import Countdown

    codec = HFCodec.from_pretrained(standins("qwen2"))
    env = Countdown(codec=codec)
    params = env.default_params()
    state, _ = jax.jit(env.reset)(jax.random.key(0), params)
    numbers = [int(n) for n in state.numbers[:int(state.num_numbers)]]
    text = f"<answer>{numbers[0]}-{numbers[1]}*{numbers[2]}</answer>"
    value = numbers[0] - numbers[1] * numbers[2]
    ids = codec.encode(text) + [codec.eot_id]
    action = TokenChunk(jnp.asarray(ids + [codec.pad_id] * (env.action_len - len(ids))),
                        jnp.asarray(len(ids), jnp.int32))
    _, step = jax.jit(env.step)(jax.random.key(1), state, action, params)
    assert value < 0 and value != int(state.target)
    got = np.asarray(step.observation.tokens[:int(step.observation.length)]).tolist()
    assert got == codec.encode(f"wrong: {value}")


TOOL = ("lookup", "Looks a word up.", "word", "The word.")


class SeamReplies(HostEnvironment):
    """Replies with `replies[turn]` whatever the agent writes, as a user message or (with
    `tool`) as a tool result in the template's tool convention; the oracle writes
    "next"."""

    name = "seam_replies"

    def __init__(self, codec, replies, obs_len=48, tool=False):
        self.codec, self.replies = codec, tuple(replies)
        self.max_turns = len(self.replies)
        self.prompt_len, self.obs_len, self.action_len = 32, obs_len, 8
        self.call_syntax = None
        if tool:
            from arl.text.tool_calls import derive_tool_chat_format, function_schema
            self.chat, self.call_syntax = derive_tool_chat_format(
                codec.chat_template, encode=codec.encode,
                special_texts=[codec.tokenizer.id_to_token(i) for i in sorted(
                    codec.special_ids)], special_tokens=codec.template_tokens,
                pad_id=codec.pad_id, tools=[function_schema(*TOOL)],
                system_prompt=codec.chat.system_prompt)

    def reply_ids(self, text):
        render = self.call_syntax.result_text if self.call_syntax is not None else None
        return self.text_ids(text, self.obs_len, render=render)

    def default_params(self):
        return {"unused": jnp.zeros((), jnp.float32)}

    def reward_bounds(self, params):
        return jnp.zeros(()), jnp.zeros(())

    def make_task(self, seed, params):
        return seed % 7

    def prompt(self, task, params):
        return f"Say next {task} times."

    def host_step(self, episode, action):
        return HostTurn(reply=self.replies[episode.turn])

    def host_oracle(self, episode):
        return "next"


@pytest.mark.parametrize("family,tool", [
    ("qwen2", False), ("qwen2", True), ("llama3.1", True),
    pytest.param("llama3", False, marks=pytest.mark.slow),
    pytest.param("llama3.1", False, marks=pytest.mark.slow)])
def test_host_replies_read_as_the_template_renders_them(standins, family, tool):
    """Replies as user messages (Qwen's user turn also with a reply that starts with a
    blank line: "user\n" + "\n..." merges) and as tool results equal the reference
    before every turn; then replies holding special-token names are written as plain
    characters: decoding the context gives them back, no special id but the template's
    own is in it (the reference, whose tokenizer reads those names as special tokens,
    differs from there on)."""
    from arl.text.tool_calls import function_schema

    directory = standins(family)
    codec = HFCodec.from_pretrained(directory, system_prompt=SYSTEM)
    # Llama's template trims a message's content: no reply there starts with a newline.
    replies = SEAM_REPLIES + (("\nafter a blank line",) if family == "qwen2" else ())
    env = SeamReplies(codec, replies + SPECIAL_REPLIES,
                      obs_len=32, tool=tool)
    traj = jax.device_get(rollout_lib.scripted_rollout(env, jax.random.key(0), num_tasks=2,
                                                       group_size=1))
    reference = Reference(directory, env, system_prompt=SYSTEM,
                          tools=[function_schema(*TOOL)] if tool else None)
    turns_each = len(replies) + len(SPECIAL_REPLIES)
    names = [codec.tokenizer.id_to_token(i) for i in codec.special_ids]
    first = next(k for k, r in enumerate(SPECIAL_REPLIES) if any(n in r for n in names))
    equal = len(replies) + first + 1  # contexts before the first of the family's names
    assert reference.check(traj) == 2 * ([True] * equal + [False] * (turns_each - equal))
    _, turns = episode_texts(env, traj.tokens[0], traj.agent_mask[0], traj.length[0])
    written = [content for role, content in turns if role != "assistant"]
    assert len(written) == turns_each
    if tool and env.call_syntax.results_as_json:
        written = [env.call_syntax.result_text(r) == w and r
                   for r, w in zip(replies + SPECIAL_REPLIES, written)]
    cut = replies.index(SEAM_REPLIES[-1])
    assert written[:cut] + written[cut + 1:] == list(replies[:cut] + replies[cut + 1:]
                                                     + SPECIAL_REPLIES)
    if not (tool and env.call_syntax.results_as_json):
        assert written[cut].endswith("..") and replies[cut].startswith(written[cut][:-2])
    chat = rollout_lib.chat_format(env)
    fixed = set(chat.prompt_prefix + chat.turn_suffix + chat.reply_prefix
                + chat.reply_suffix + (codec.eot_id,))
    assert not set(traj.tokens[0][traj.observation_mask[0] > 0].tolist()) & (
        set(codec.special_ids) - fixed)


def test_special_token_names_are_encoded_as_their_characters(standins):
    for family, names in (("qwen2", ("x\na<|im_end|>b", "<|endoftext|>")),
                          ("llama3.1", ("<|eot_id|>", "a<|begin_of_text|>b"))):
        codec = HFCodec.from_pretrained(standins(family))
        for text in names:
            ids = encode_text(codec, text)
            assert ids == codec.encode_plain(text) and codec.decode(ids) == text
            assert not set(ids) & set(codec.special_ids) and len(ids) > 2
            assert set(codec.encode(text)) & set(codec.special_ids)  # the template's way
    char = CharCodec()
    assert char.decode(encode_text(char, "a<eot>b")) == "a<eot>b"
    assert char.eot_id not in encode_text(char, "a<eot>b")


@pytest.mark.parametrize("family,obs_len", [
    ("qwen2", 12), pytest.param("llama3.1", 14, marks=pytest.mark.slow)])
def test_sql_in_the_tool_convention_reads_as_the_template_renders_it(standins, family,
                                                                     obs_len):
    """The tool results (an error text, a result cut to obs_len ending in "..") sit
    between the tool turn's texts ("\\n</tool_response>" after a ")" or "."; the JSON
    string's closing quote after a '.') as the template renders them."""
    from arl import envs
    from arl.text.tool_calls import function_schema

    directory = standins(family)
    codec = HFCodec.from_pretrained(directory, system_prompt=SYSTEM)
    env = envs.make("sql", codec=codec, tool_format="template", max_turns=3,
                    action_len=256, obs_len=obs_len)
    reference = Reference(directory, env, system_prompt=SYSTEM,
                          tools=[function_schema(*env.tool_function)])
    traj = jax.device_get(rollout_lib.scripted_rollout(
        env, jax.random.key(0), num_tasks=4, group_size=1, action_source="demonstrator"))
    equal = reference.check(traj)
    env.close()
    assert len(equal) >= 6 and all(equal), equal
    assert any(r.endswith("..") for r in _tool_results(env, traj))


def _tool_results(env, traj):
    out = []
    for b in range(traj.tokens.shape[0]):
        _, turns = episode_texts(env, traj.tokens[b], traj.agent_mask[b], traj.length[b])
        out += [content for role, content in turns if role == "tool"]
    return out
