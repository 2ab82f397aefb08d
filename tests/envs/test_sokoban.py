"""sokoban: moves, pushes and rewards against a plain-Python reference on random turn
sequences (hypothesis), every generated level solvable (a Python breadth-first search and
the oracle), rendering round trip, hand-computed gym-sokoban rewards, oracle and
demonstrator success, fuzzing, per-row difficulty and a BPE codec."""

import functools
from collections import Counter, deque

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arl.envs as E
from arl.envs.tasks import sokoban
from arl.envs.base import TokenChunk
from tests.envs.helpers import corrupted_turns

BATCH = 256
ENV = E.Sokoban()
PARAMS = ENV.default_params()
CODEC = ENV.codec
K = ENV.max_actions_per_turn

RESET = jax.jit(jax.vmap(ENV.reset, in_axes=(0, None)))
STEP = jax.jit(jax.vmap(ENV.step, in_axes=(0, 0, 0, None)))
ORACLE = jax.jit(jax.vmap(ENV.oracle_action, in_axes=(0, 0, None)))
DEMO = jax.jit(jax.vmap(ENV.demonstrator_action, in_axes=(0, 0, None)))


def row(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def text_actions(texts, width=ENV.action_len):
    texts = list(texts) + [texts[-1]] * (BATCH - len(texts))
    rows = [CODEC.encode_padded(t, width) for t in texts]
    return TokenChunk(jnp.asarray(np.stack([r[0] for r in rows])),
                      jnp.asarray([r[1] for r in rows], jnp.int32))


# ------------------------------------------------------------------ reference

MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
SPELLINGS = {s: d for d in MOVES for s in (d, d.lower(), d[0])}


class Level:
    """A plain-Python Sokoban level parsed from the rendered text."""

    def __init__(self, text):
        self.rows = text.split("\n")
        self.walls, self.targets, self.boxes = set(), set(), set()
        for r, line in enumerate(self.rows):
            for c, ch in enumerate(line):
                assert ch in "#_OX*PS", (ch, text)
                if ch == "#":
                    self.walls.add((r, c))
                if ch in "O*S":
                    self.targets.add((r, c))
                if ch in "X*":
                    self.boxes.add((r, c))
                if ch in "PS":
                    self.player = (r, c)

    def render(self):
        out = []
        for r, line in enumerate(self.rows):
            chars = []
            for c in range(len(line)):
                cell = (r, c)
                if cell in self.walls:
                    chars.append("#")
                elif cell == self.player:
                    chars.append("S" if cell in self.targets else "P")
                elif cell in self.boxes:
                    chars.append("*" if cell in self.targets else "X")
                else:
                    chars.append("O" if cell in self.targets else "_")
            out.append("".join(chars))
        return "\n".join(out)

    def solved(self):
        return self.boxes <= self.targets

    def distance(self):
        """Sum over boxes of the Manhattan distance to the nearest target."""
        return sum(min(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t in self.targets)
                   for b in self.boxes)

    def move(self, name):
        dr, dc = MOVES[name]
        r, c = self.player
        nxt, beyond = (r + dr, c + dc), (r + 2 * dr, c + 2 * dc)
        if nxt in self.walls:
            return
        if nxt in self.boxes:
            if beyond in self.walls or beyond in self.boxes:
                return
            self.boxes = (self.boxes - {nxt}) | {beyond}
        self.player = nxt


def parse_turn(text):
    """The moves of a turn, or None if malformed (the env's grammar)."""
    content = text.split("<eot>")[0]
    parts = content.split(",")
    if not 1 <= len(parts) <= K or any(p not in SPELLINGS for p in parts):
        return None
    return [SPELLINGS[p] for p in parts]


def reference_turn(level, text, step=-0.1, on=1.0, off=-1.0, success=10.0, penalty=0.1):
    """(reply, reward, format_error) of one turn on `level` (mutated), gym-sokoban rules."""
    moves = parse_turn(text)
    if moves is None:
        return "invalid\n" + level.render(), -penalty, True
    reward = 0.0
    for name in moves:
        if level.solved():
            break  # the rest of the turn is ignored once solved
        before = len(level.boxes & level.targets)
        level.move(name)
        after = len(level.boxes & level.targets)
        reward += step + on * (after > before) + off * (after < before)
        reward += success * level.solved()
    return level.render(), reward, False


def random_turn(rng):
    if rng.random() < 0.15:
        return str(rng.choice(["", "Up,", "Up, Left", "Jump", "Up,Up,Up,Up", ",", "UP",
                               "up left", "Left<eot>x", "R,,L", "x" * 18]))
    count = int(rng.integers(1, K + 1))
    names = [str(rng.choice(list(SPELLINGS))) for _ in range(count)]
    return ",".join(names) + ("<eot>" if rng.random() < 0.7 else "")


# ------------------------------------------------------------------ rules vs reference


@settings(max_examples=6, deadline=None, derandomize=True,  # each example compiles
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), size=st.sampled_from([5, 6]),
       num_boxes=st.sampled_from([1, 2]), wall_prob=st.sampled_from([0.0, 0.1, 0.3]),
       oracle_share=st.sampled_from([0.0, 0.5, 0.9]))
def test_moves_pushes_and_rewards_match_the_python_reference(seed, size, num_boxes, wall_prob,
                                                            oracle_share):
    """Random turns (random spellings, malformed ones, and oracle turns so that boxes
    reach targets) on generated levels: every reply, reward, flag and process reward
    equals the plain-Python reference's, turn by turn."""
    params = ENV.default_params(size=size, num_boxes=num_boxes, wall_prob=wall_prob)
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    state, first = RESET(jax.random.split(key, BATCH), params)
    levels = [Level(ENV.render_chunk(row(first.observation, i))) for i in range(BATCH)]
    starts = [max(level.distance(), 1) for level in levels]
    done = np.zeros(BATCH, bool)
    for turn in range(ENV.max_turns):
        key, key_act, key_step = jax.random.split(key, 3)
        oracle = ORACLE(jax.random.split(key_act, BATCH), state, params)
        texts = [ENV.render_chunk(row(oracle, i)) if rng.random() < oracle_share
                 else random_turn(rng) for i in range(BATCH)]
        state, ts = STEP(jax.random.split(key_step, BATCH), state, text_actions(texts), params)
        for i in range(BATCH):
            got = ENV.render_chunk(row(ts.observation, i))
            if done[i]:
                assert got == "" and float(ts.reward[i]) == 0.0
                continue
            before = levels[i].distance()
            reply, reward, error = reference_turn(levels[i], texts[i])
            assert got == reply, (texts[i], got, reply)
            assert float(ts.reward[i]) == pytest.approx(reward, abs=1e-5), texts[i]
            assert bool(ts.info["format_error"][i]) == error
            assert bool(ts.terminated[i]) == bool(ts.info["success"][i]) == levels[i].solved()
            expected = (before - levels[i].distance()) / starts[i]
            assert float(ts.info["process_reward"][i]) == pytest.approx(expected, abs=1e-6)
            done[i] = levels[i].solved() or turn + 1 == ENV.max_turns
        np.testing.assert_array_equal(np.asarray(ts.done), done)


def test_hand_computed_gym_sokoban_rewards():
    """RAGEN / gym-sokoban rewards: −0.1 per move, +1 onto a target, −1 off a target,
    +10 when all boxes are on targets; −0.1 for a malformed turn."""
    one_box = ENV.level_state("######\n#____#\n#_PXO#\n#____#\n#____#\n######")
    two_boxes = ENV.level_state("######\n#____#\n#P*O_#\n#____#\n#_X__#\n######")
    blocked = ENV.level_state("######\n#O___#\n#__PX#\n#__X_#\n#__#O#\n######")
    cases = [  # state, turn, reward, terminated, player after, format error
        (one_box, "Right<eot>", 10.9, True, (2, 3), False),
        (one_box, "Right,Left", 10.9, True, (2, 3), False),  # moves after success ignored
        (one_box, "R", 10.9, True, (2, 3), False),
        (one_box, "r", -0.1, False, (2, 2), True),  # letters are upper case
        (one_box, "Left", -0.1, False, (2, 1), False),
        (one_box, "Up,Up,Up", -0.3, False, (1, 2), False),  # bumps into the wall
        (one_box, "Up,right,D", -0.3, False, (2, 3), False),  # pushes the box down, no target
        (one_box, "Up,Up,Up,Up", -0.1, False, (2, 2), True),  # more than K moves
        (one_box, "Up,", -0.1, False, (2, 2), True),
        (one_box, "Up, Left", -0.1, False, (2, 2), True),
        (one_box, "", -0.1, False, (2, 2), True),
        (one_box, "Jump", -0.1, False, (2, 2), True),
        (two_boxes, "Right", -0.1, False, (2, 2), False),  # target to target: no change
        (two_boxes, "Right,Right", -1.2, False, (2, 3), False),  # then off a target
        (two_boxes, "Down,Down,Right", -0.3, False, (4, 2), False),  # pushes the lower box
        (blocked, "Right", -0.1, False, (2, 3), False),  # a box against the wall stays
        (blocked, "Down,Right", -0.2, False, (2, 3), False),  # box onto a wall, box to wall
    ]
    for state, text, reward, terminated, player, error in cases:
        states = jax.tree.map(lambda x: jnp.broadcast_to(x, (BATCH,) + x.shape), state)
        new, ts = STEP(jax.random.split(jax.random.key(0), BATCH), states,
                       text_actions([text]), PARAMS)
        assert float(ts.reward[0]) == pytest.approx(reward, abs=1e-5), text
        assert bool(ts.terminated[0]) == bool(ts.info["success"][0]) == terminated, text
        assert divmod(int(new.player[0]), ENV.max_size) == player, text
        assert bool(ts.info["format_error"][0]) == error, text
        level = Level(ENV.render_chunk(row(ts.observation, 0)).removeprefix("invalid\n"))
        assert level.player == player
    states = jax.tree.map(lambda x: jnp.broadcast_to(x, (BATCH,) + x.shape), two_boxes)
    _, ts = STEP(jax.random.split(jax.random.key(0), BATCH), states,
                 text_actions(["Right,Right"]), PARAMS)
    assert ENV.render_chunk(row(ts.observation, 0)) == (
        "######\n#____#\n#_OSX#\n#____#\n#_X__#\n######")
    # Process reward: h = 2 at the start ((4,2) is 2 from the target (2,2)), 3 after
    # pushing the top box off its target, away from both: (2 - 3) / 2.
    assert int(two_boxes.start_distance) == 2
    assert float(ts.info["process_reward"][0]) == pytest.approx(-0.5)
    lo, hi = ENV.reward_bounds(PARAMS)
    assert (float(lo), float(hi)) == pytest.approx((-3.3, 12.7))


def bfs_moves(level):
    """Fewest moves that solve `level` (plain breadth-first search), or None."""
    start = (level.player, frozenset(level.boxes))
    seen, queue = {start}, deque([(start, 0)])
    while queue:
        (player, boxes), depth = queue.popleft()
        if boxes <= level.targets:
            return depth
        for dr, dc in MOVES.values():
            nxt = (player[0] + dr, player[1] + dc)
            beyond = (player[0] + 2 * dr, player[1] + 2 * dc)
            if nxt in level.walls:
                continue
            new_boxes = boxes
            if nxt in boxes:
                if beyond in level.walls or beyond in boxes:
                    continue
                new_boxes = (boxes - {nxt}) | {beyond}
            state = (nxt, new_boxes)
            if state not in seen:
                seen.add(state)
                queue.append((state, depth + 1))
    return None


def rollout(policy, params, key):
    key_reset, key = jax.random.split(key)
    state, first = RESET(jax.random.split(key_reset, BATCH), params)
    errors = 0
    for _ in range(ENV.max_turns):
        key, key_act, key_step = jax.random.split(key, 3)
        action = policy(jax.random.split(key_act, BATCH), state, params)
        state, ts = STEP(jax.random.split(key_step, BATCH), state, action, params)
        errors += int(ts.info["format_error"].sum())
    return first, state, errors


@pytest.mark.parametrize("settings_", [
    dict(), dict(num_boxes=2), dict(size=5), dict(wall_prob=0.3, num_boxes=2),
    dict(num_reverse_moves=3)], ids=["default", "two_boxes", "size5", "walls", "short"])
def test_every_level_is_solvable_and_the_oracle_solves_it(settings_):
    """256 levels per setting: a Python BFS solves each (the level is never already
    solved); the oracle solves each within max_turns, with no fewer moves than the BFS
    optimum and no more than num_reverse_moves."""
    params = ENV.default_params(**settings_)
    first, state, errors = rollout(ORACLE, params, jax.random.key(len(str(settings_))))
    assert bool(jnp.all(state.success)) and errors == 0
    size = int(params.size)
    optimal = []
    for i in range(BATCH):
        level = Level(ENV.render_chunk(row(first.observation, i)))
        assert len(level.rows) == size and all(len(r) == size for r in level.rows)
        border = {(r, c) for r in range(size) for c in range(size)
                  if r in (0, size - 1) or c in (0, size - 1)}
        assert border <= level.walls and level.player not in level.walls | level.boxes
        assert len(level.boxes) == len(level.targets) == int(params.num_boxes)
        assert not level.solved()
        moves = bfs_moves(level)
        assert moves is not None and moves <= int(state.moves[i])
        optimal.append(moves)
    assert int(jnp.max(state.moves)) <= int(params.num_reverse_moves)
    # The difficulty knobs act: ~5.5 optimal moves at the defaults (8 walks, the longest
    # kept), at most 3 with 3 reverse moves.
    if not settings_:
        assert np.mean(optimal) >= 4.5 and max(optimal) <= ENV.max_moves
    if "num_reverse_moves" in settings_:
        assert max(optimal) <= 3 and np.mean(optimal) >= 2


def test_oracle_and_demonstrator_success_at_the_defaults():
    """512 levels: the oracle solves all; the noisy demonstrator ~0.7 (measurably less)."""
    demo = []
    for seed in (1, 2):
        _, state, errors = rollout(ORACLE, PARAMS, jax.random.key(seed))
        assert bool(jnp.all(state.success)) and errors == 0
        _, demo_state, demo_errors = rollout(DEMO, PARAMS, jax.random.key(seed))
        assert demo_errors == 0
        demo.append(np.asarray(demo_state.success))
    assert 0.5 < np.mean(demo) < 0.85, np.mean(demo)


def test_rendering_round_trip_and_hand_written_levels():
    state, first = RESET(jax.random.split(jax.random.key(3), BATCH), PARAMS)
    for i in range(16):
        text = ENV.render_chunk(row(first.observation, i))
        rebuilt = ENV.level_state(text)
        original = row(state, i)
        for field in ("walls", "targets", "boxes", "player", "size"):
            np.testing.assert_array_equal(getattr(rebuilt, field), getattr(original, field))
        assert ENV.render_chunk(ENV.grid_chunk(rebuilt)) == text
        assert int(first.observation.length[i]) == ENV.prompt_len == 41
    text = "#####\n#S*_#\n#_X_#\n#___#\n#####"
    hand = ENV.level_state(text)
    assert ENV.render_chunk(ENV.grid_chunk(hand)) == text
    assert int(hand.start_distance) == 1 and int(hand.size) == 5
    for bad in ["####\n#P_#\n####", "#####\n#P_X#\n#___#\n#___#\n#####",
                "#####\n#PPO#\n#X__#\n#___#\n#####", "#####\n#P@O#\n#X__#\n#___#\n#####",
                "#####\n#P_O_\n#X__#\n#___#\n#####"]:
        with pytest.raises(ValueError):
            ENV.level_state(bad)


def test_per_row_difficulty_under_vmap_of_params():
    params = E.broadcast_params(PARAMS, 8).replace(
        size=jnp.asarray([5, 6, 5, 6, 5, 6, 5, 6], jnp.int32),
        num_boxes=jnp.asarray([1, 1, 2, 2, 1, 1, 2, 2], jnp.int32))
    state, ts = jax.jit(jax.vmap(ENV.reset))(jax.random.split(jax.random.key(0), 8), params)
    for i in range(8):
        level = Level(ENV.render_chunk(row(ts.observation, i)))
        assert len(level.rows) == int(params.size[i])
        assert len(level.boxes) == int(params.num_boxes[i])


def test_fuzz_random_actions():
    """40 steps x 256 rows of garbage and corrupted oracle turns: no NaN, rewards within
    reward_bounds, finished rows unchanged, truncation at max_turns."""
    low, high = (float(b) for b in ENV.reward_bounds(PARAMS))
    corrupt = jax.jit(functools.partial(corrupted_turns, vocab_size=CODEC.vocab_size,
                                        garbage_prob=0.05))

    key = jax.random.key(7)
    state, _ = RESET(jax.random.split(key, BATCH), PARAMS)
    seen = Counter()
    for t in range(40):
        key, k_act, k_step, k_reset = jax.random.split(key, 4)
        action = corrupt(k_act, ORACLE(jax.random.split(k_act, BATCH), state, PARAMS))
        was_done = np.asarray(state.terminated | state.truncated)
        old = state
        state, ts = STEP(jax.random.split(k_step, BATCH), state, action, PARAMS)
        reward = np.asarray(ts.reward)
        assert np.all(np.isfinite(reward))
        assert np.all(np.isfinite(np.asarray(ts.info["process_reward"])))
        assert reward.min() >= low - 1e-6 and reward.max() <= high + 1e-6
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(a)[was_done], np.asarray(b)[was_done])
        assert np.all(reward[was_done] == 0)
        turn = np.asarray(ts.info["turn"])
        assert np.all(np.asarray(ts.done)[turn == ENV.max_turns])
        live = ~was_done
        assert np.all(np.asarray(ts.observation.length)[live] > 0)
        seen["error"] += int(np.asarray(ts.info["format_error"])[live].sum())
        seen["success"] += int(np.asarray(ts.info["success"])[live].sum())
        seen["valid"] += int((~np.asarray(ts.info["format_error"]))[live].sum())
        if t % 4 == 3:
            fresh, _ = RESET(jax.random.split(k_reset, BATCH), PARAMS)
            done = state.terminated | state.truncated
            state = jax.tree.map(lambda a, b: jnp.where(
                done.reshape(done.shape + (1,) * (a.ndim - 1)), a, b), fresh, state)
    assert seen["error"] > 1000 and seen["success"] > 50 and seen["valid"] > 500, seen


def test_process_reward_telescopes_on_solved_episodes():
    key_reset, key = jax.random.split(jax.random.key(4))
    state, _ = RESET(jax.random.split(key_reset, BATCH), PARAMS)
    total = np.zeros(BATCH)
    for _ in range(ENV.max_turns + 1):
        key, key_act, key_step = jax.random.split(key, 3)
        action = DEMO(jax.random.split(key_act, BATCH), state, PARAMS)
        state, ts = STEP(jax.random.split(key_step, BATCH), state, action, PARAMS)
        total += np.asarray(ts.info["process_reward"])
    success = np.asarray(state.success)
    assert 0 < success.mean() < 1
    np.testing.assert_allclose(total[success], 1.0, atol=1e-5)
    assert np.all(total[~success] < 1.0 - 1e-3)


def test_constructor_and_params_errors():
    for kwargs, match in [(dict(max_size=4), "max_size must be an int in \\[5, 12\\]"),
                          (dict(max_boxes=0), "max_boxes"),
                          (dict(max_actions_per_turn=0), "max_actions_per_turn"),
                          (dict(max_turns=0), "max_turns")]:
        with pytest.raises(ValueError, match=match):
            E.make("sokoban", **kwargs)
    for kwargs, match in [(dict(size=7), "size must be in \\[5, max_size=6\\]"),
                          (dict(num_boxes=3), "num_boxes"),
                          (dict(num_reverse_moves=13), "num_reverse_moves.*12"),
                          (dict(wall_prob=1.0), "wall_prob")]:
        with pytest.raises(ValueError, match=match):
            ENV.default_params(**kwargs)
    # Context at the defaults: 1 + prompt + max_turns * (action + reply).
    assert (ENV.prompt_len, ENV.obs_len, ENV.action_len, ENV.max_turns) == (41, 49, 18, 4)
    assert sokoban.SYMBOLS == "#_OX*PS"


def test_bpe_codec():
    """On a BPE trained with grids and turns: the oracle solves every level with no
    format error; the prompt decodes to the grid."""
    pytest.importorskip("tokenizers")
    from arl.text.hf_codec import HFCodec, train_bpe_tokenizer

    state, first = RESET(jax.random.split(jax.random.key(8), BATCH), PARAMS)
    corpus = [ENV.render_chunk(row(first.observation, i)) for i in range(64)]
    corpus += ["invalid", "Up,Left,Down", "Right,Right", "up,down", "U,L,R,D"] * 20
    codec = HFCodec(train_bpe_tokenizer(corpus, vocab_size=300))
    env = E.make("sokoban", codec=codec)
    assert env.action_len < ENV.action_len  # words are single subword ids
    params = env.default_params()
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
    step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    oracle = jax.jit(jax.vmap(env.oracle_action, in_axes=(0, 0, None)))
    keys = jax.random.split(jax.random.key(8), 64)
    state, ts = reset(keys, params)
    np.testing.assert_array_equal(state.boxes, np.asarray(RESET(
        jax.random.split(jax.random.key(8), BATCH), PARAMS)[0].boxes)[:64])
    assert codec.decode(np.asarray(ts.observation.tokens[0])) == ENV.render_chunk(
        row(first.observation, 0))
    errors = 0
    for turn in range(env.max_turns):
        action = oracle(keys, state, params)
        if turn == 0:
            text = codec.decode(np.asarray(action.tokens[0]))
            assert text.endswith("<eot>") and codec.encode(text) == list(
                np.asarray(action.tokens[0])[: int(action.length[0])])
        state, ts = step(keys, state, action, params)
        errors += int(ts.info["format_error"].sum())
    assert bool(jnp.all(state.success)) and errors == 0
