"""`frozen_lake`: the RAGEN text grid world, with random solvable maps made in JAX.

The observation is the rendered grid, one row per line (RAGEN symbols):
  P player, _ frozen ice, O hole, G goal, X player fallen in a hole, * player on goal.
Actions are one word or letter per turn: Left/Down/Right/Up, left/down/right/up or
L/D/R/U, then end-of-turn. Walking into the border leaves the player in place. With
`slip_prob` > 0 the ice is slippery: the move goes to one of the two perpendicular
directions (each with probability slip_prob / 2). Stepping on a hole terminates with
no success; reaching the goal terminates with success. A malformed turn leaves the
player in place and the reply is "invalid" above the grid.

Maps: start and goal are distinct uniform cells, every other cell is a hole with
probability `hole_prob`; a map whose goal is not reachable from the start (flood fill,
size² fixed iterations) is resampled inside a `lax.while_loop` (up to 64 tries, then the
holes are dropped), so every map is solvable.

Reward per step: success_reward·[goal] − turn_cost − format_penalty·[malformed],
in [−(turn_cost + format_penalty), success_reward − turn_cost].

Process reward (`info["process_reward"]`, not part of the reward): the realised progress
of the move toward the goal,

    (d(before) − d(after)) / d(start),

where d is the true shortest-path distance to the goal avoiding holes (BFS distances,
computed once per map in `reset` and kept in the state as `distance`; d(start) ≥ 1 is
kept as `start_distance`). It is measured on where the player actually ended up, so a
slipped move scores its real effect (−1/d(start) when it went the wrong way). Bumping
into a wall and malformed turns give 0; stepping into a hole gives 0 (the distance from a
hole is undefined; the failure is the outcome reward's business). Reaching the goal
collects exactly d(start)/d(start) = 1 in total over the episode, whatever the path (a
direct path is d(start) steps of 1/d(start)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arl.text import chunks, parsing, turn_text
from arl.envs.base import (NON_NEGATIVE, PROBABILITY, ParamRange, TokenChunk,
                           TokenEnvironment, TokenEnvState)
from arl.text.codec import CharCodec, Codec

DIRECTIONS = ("Left", "Down", "Right", "Up")  # action indices 0..3, as in gym
MOVES = np.array([[0, -1], [1, 0], [0, 1], [-1, 0]], np.int32)  # (row, col) deltas
SYMBOLS = "_OGPX*"  # frozen, hole, goal, player, player in hole, player on goal
FROZEN, HOLE, GOAL = 0, 1, 2
INVALID_TEXT = "invalid\n"
MAX_MAP_TRIES = 64
UNREACHABLE = 10**6


@struct.dataclass
class FrozenLakeParams:
    hole_prob: jax.Array  # float32, probability that a cell is a hole
    slip_prob: jax.Array  # float32, probability that a move slips sideways (0 = not slippery)
    turn_cost: jax.Array
    format_penalty: jax.Array
    success_reward: jax.Array


@struct.dataclass
class FrozenLakeState(TokenEnvState):
    cells: jax.Array  # int32 [size*size]: FROZEN / HOLE / GOAL
    position: jax.Array  # int32, flat index of the player
    # int32 [size*size]: distance_to_goal(cells), fixed per map (recompute it when
    # editing `cells` by hand); used by the process reward.
    distance: jax.Array
    start_distance: jax.Array  # int32, distance[start] (>= 1): the process-reward scale


def _neighbours(flags: jax.Array) -> jax.Array:
    """For a bool [n, n] grid: cells with a True 4-neighbour."""
    padded = jnp.pad(flags, 1)
    return padded[:-2, 1:-1] | padded[2:, 1:-1] | padded[1:-1, :-2] | padded[1:-1, 2:]


def reachable(cells: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """bool [size*size]: cells reachable from `start` without entering a hole."""
    open_cells = (cells != HOLE).reshape(size, size)
    seen = (jnp.arange(size * size) == start).reshape(size, size)
    seen = jax.lax.fori_loop(0, size * size, lambda _, s: s | (_neighbours(s) & open_cells), seen)
    return seen.reshape(-1)


def distance_to_goal(cells: jax.Array, size: int) -> jax.Array:
    """int32 [size*size] shortest number of moves to the goal avoiding holes
    (UNREACHABLE where there is no path, and on holes)."""
    grid = cells.reshape(size, size)
    dist = jnp.where(grid == GOAL, 0, UNREACHABLE)

    def relax(_, d):
        padded = jnp.pad(d, 1, constant_values=UNREACHABLE)
        best = jnp.minimum(jnp.minimum(padded[:-2, 1:-1], padded[2:, 1:-1]),
                           jnp.minimum(padded[1:-1, :-2], padded[1:-1, 2:]))
        return jnp.where(grid == HOLE, UNREACHABLE, jnp.minimum(d, best + 1))

    return jax.lax.fori_loop(0, size * size, relax, dist).reshape(-1)


class FrozenLake(TokenEnvironment):
    """Frozen lake on a `size` x `size` grid (static; default 4)."""

    name = "frozen_lake"

    def __init__(self, codec: Codec | None = None, size: int = 4, max_turns: int | None = None):
        if not isinstance(size, int) or not 2 <= size <= 12:
            raise ValueError(f"size must be an int in [2, 12], got {size!r}")
        self.codec = codec or CharCodec()
        self.size = size
        self.max_turns = int(max_turns if max_turns is not None else size * size)
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.grid_len = size * (size + 1) - 1
        self.prompt_len = self.grid_len
        self.obs_len = len(INVALID_TEXT) + self.grid_len
        self.action_len = max(len(d) for d in DIRECTIONS) + 1
        # One id per symbol (a subword codec may merge "OG" when encoding SYMBOLS whole).
        self._symbol_ids = np.array([self.codec.token_id(s) for s in SYMBOLS], np.int32)
        self._newline = self.codec.token_id("\n")
        # Accepted spellings of each move, as text (the turn is read as text).
        self._patterns = [[turn_text.text_ids(d), turn_text.text_ids(d.lower()),
                           turn_text.text_ids(d[0])] for d in DIRECTIONS]
        self._read = turn_text.TurnReader(self.codec)

    def default_params(self, hole_prob: float = 0.2, slip_prob: float = 0.0) -> FrozenLakeParams:
        if not 0.0 <= hole_prob < 1.0:
            raise ValueError(f"hole_prob must be in [0, 1), got {hole_prob}")
        if not 0.0 <= slip_prob <= 1.0:
            raise ValueError(f"slip_prob must be in [0, 1], got {slip_prob}")
        return FrozenLakeParams(
            hole_prob=jnp.asarray(hole_prob, jnp.float32),
            slip_prob=jnp.asarray(slip_prob, jnp.float32),
            turn_cost=jnp.asarray(0.0, jnp.float32),
            format_penalty=jnp.asarray(0.1, jnp.float32),
            success_reward=jnp.asarray(1.0, jnp.float32),
        )

    def param_ranges(self):
        """hole_prob in [0, 1) (a map of holes only has no path), slip_prob in [0, 1];
        rewards, costs and penalties >= 0."""
        return dict(hole_prob=ParamRange(0.0, 1.0, high_open=True), slip_prob=PROBABILITY,
                    turn_cost=NON_NEGATIVE, format_penalty=NON_NEGATIVE,
                    success_reward=NON_NEGATIVE)

    def reward_bounds(self, params: FrozenLakeParams):
        return -(params.turn_cost + params.format_penalty), params.success_reward - params.turn_cost

    # -- maps
    def _sample_map(self, key, hole_prob):
        n = self.size * self.size
        key_start, key_goal, key_holes = jax.random.split(key, 3)
        start = jax.random.randint(key_start, (), 0, n, jnp.int32)
        goal = (start + jax.random.randint(key_goal, (), 1, n, jnp.int32)) % n
        cell = jnp.arange(n)
        holes = jax.random.bernoulli(key_holes, hole_prob, (n,)) & (cell != start) & (cell != goal)
        cells = jnp.where(cell == goal, GOAL, jnp.where(holes, HOLE, FROZEN)).astype(jnp.int32)
        return cells, start

    def sample_map(self, key, params: FrozenLakeParams):
        """(cells int32 [size*size], start int32) of a solvable random map."""
        def solvable(cells, start):
            return jnp.any(reachable(cells, start, self.size) & (cells == GOAL))

        def body(carry):
            key, tries, _, _, _ = carry
            key, sub = jax.random.split(key)
            cells, start = self._sample_map(sub, params.hole_prob)
            return key, tries + 1, cells, start, solvable(cells, start)

        def cond(carry):
            _, tries, _, _, ok = carry
            return (~ok) & (tries < MAX_MAP_TRIES)

        cells, start = self._sample_map(key, params.hole_prob)
        init = (jax.random.fold_in(key, 1), jnp.ones((), jnp.int32), cells, start,
                solvable(cells, start))
        _, _, cells, start, ok = jax.lax.while_loop(cond, body, init)
        cells = jnp.where(ok | (cells != HOLE), cells, FROZEN)
        return cells, start

    # -- text
    def grid_chunk(self, cells: jax.Array, position: jax.Array) -> TokenChunk:
        n = self.size
        here = jnp.arange(n * n) == position
        symbol = jnp.where(here, jnp.array([3, 4, 5])[jnp.clip(cells, 0, 2)], cells)
        ids = jnp.asarray(self._symbol_ids)[symbol].reshape(n, n)
        rows = jnp.concatenate([ids, jnp.full((n, 1), self._newline, jnp.int32)], axis=1)
        tokens = rows.reshape(-1)[: self.grid_len]
        return TokenChunk(tokens=tokens.astype(jnp.int32), length=jnp.asarray(self.grid_len, jnp.int32))

    def place(self, state: FrozenLakeState, cells, position) -> FrozenLakeState:
        """`state` on the map `cells` (int32 [size*size]) with the player at `position`
        (also its start): the distances are recomputed (for hand-made maps in tests)."""
        cells = jnp.asarray(cells, jnp.int32)
        position = jnp.asarray(position, jnp.int32)
        distance = distance_to_goal(cells, self.size).astype(jnp.int32)
        return state.replace(cells=cells, position=position, distance=distance,
                             start_distance=jnp.maximum(distance[position], 1).astype(jnp.int32))

    # -- dynamics
    def _reset(self, key, params):
        cells, start = self.sample_map(key, params)
        distance = distance_to_goal(cells, self.size).astype(jnp.int32)
        false = jnp.zeros((), bool)
        state = FrozenLakeState(
            turn=jnp.zeros((), jnp.int32), terminated=false, truncated=false, success=false,
            cells=cells, position=start, distance=distance,
            start_distance=jnp.maximum(distance[start], 1).astype(jnp.int32),
        )
        return state, self.grid_chunk(cells, start)

    def _parse_direction(self, content: TokenChunk):
        text = self._read(content)
        matches = []
        for patterns in self._patterns:
            hit = jnp.zeros((), bool)
            for pattern in patterns:
                hit = hit | parsing.equals(text.tokens, text.length, pattern)
            matches.append(hit)
        matches = jnp.stack(matches)
        return jnp.argmax(matches).astype(jnp.int32), jnp.any(matches)

    def move(self, position: jax.Array, direction: jax.Array) -> jax.Array:
        row, col = position // self.size, position % self.size
        delta = jnp.asarray(MOVES)[direction]
        row = jnp.clip(row + delta[0], 0, self.size - 1)
        col = jnp.clip(col + delta[1], 0, self.size - 1)
        return (row * self.size + col).astype(jnp.int32)

    def _transition(self, key, state, content: TokenChunk, params):
        direction, valid = self._parse_direction(content)
        key_slip, key_side = jax.random.split(key)
        slips = jax.random.uniform(key_slip) < params.slip_prob
        side = jnp.where(jax.random.uniform(key_side) < 0.5, 1, 3)
        direction = jnp.where(slips, (direction + side) % 4, direction)
        position = jnp.where(valid, self.move(state.position, direction), state.position)
        cell = state.cells[position]
        new_state = state.replace(
            position=position, terminated=cell != FROZEN, success=cell == GOAL)
        reward = (params.success_reward * (cell == GOAL) - params.turn_cost
                  - params.format_penalty * (~valid))
        grid = self.grid_chunk(state.cells, position)
        invalid_prefix = chunks.constant_chunk(self.codec, INVALID_TEXT, len(INVALID_TEXT))
        with_prefix = chunks.concat_chunks(invalid_prefix, grid, self.obs_len, self.codec.pad_id)
        plain = chunks.pad_chunk(grid, self.obs_len, self.codec.pad_id)
        observation = jax.tree.map(lambda a, b: jnp.where(valid, a, b), plain, with_prefix)
        return new_state, observation, reward, ~valid

    def process_reward(self, old_state: FrozenLakeState, new_state: FrozenLakeState,
                       params) -> jax.Array:
        """(d(before) − d(after)) / d(start) on shortest-path distances; 0 on a hole."""
        del params
        before = old_state.distance[old_state.position]
        after = new_state.distance[new_state.position]
        in_hole = new_state.cells[new_state.position] == HOLE
        progress = jnp.where(in_hole | (after >= UNREACHABLE) | (before >= UNREACHABLE),
                             0, before - after)
        scale = jnp.maximum(old_state.start_distance, 1).astype(jnp.float32)
        return (progress.astype(jnp.float32) / scale).astype(jnp.float32)

    # -- teachers
    def _direction_chunk(self, direction: jax.Array) -> TokenChunk:
        turns = [chunks.with_eot(self.codec, d) for d in DIRECTIONS]
        return chunks.select_ids(self.codec, direction, turns, self.action_len)

    def oracle_direction(self, state: FrozenLakeState) -> jax.Array:
        """A move along a shortest hole-free path to the goal (optimal when not slippery)."""
        dist = distance_to_goal(state.cells, self.size)
        targets = jax.vmap(lambda d: self.move(state.position, d))(jnp.arange(4))
        return jnp.argmin(dist[targets]).astype(jnp.int32)

    def oracle_action(self, key, state: FrozenLakeState, params) -> TokenChunk:
        del key, params
        return self._direction_chunk(self.oracle_direction(state))

    def demonstrator_action(self, key, state: FrozenLakeState, params,
                            noise: float = 0.3) -> TokenChunk:
        """A weaker teacher: a uniformly random direction with probability `noise`."""
        del params
        key_coin, key_dir = jax.random.split(key)
        random_dir = jax.random.randint(key_dir, (), 0, 4, jnp.int32)
        direction = jnp.where(jax.random.uniform(key_coin) < noise, random_dir,
                              self.oracle_direction(state))
        return self._direction_chunk(direction)
