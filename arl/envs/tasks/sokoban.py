"""`sokoban`: RAGEN's main environment, box pushing on a text grid, levels made in JAX.

Grid legend (RAGEN's symbols; `*` stands for RAGEN's `√`, which no built-in codec has):

    #  wall              _  empty floor        O  target
    X  box off target    *  box on target
    P  player            S  player on a target

The prompt is the rendered grid, one row per line. A turn is 1 to `max_actions_per_turn`
moves separated by commas, then end-of-turn, e.g. "Up,Left,Left<eot>" (RAGEN writes
"Up || Left" inside answer tags; the turn is read as text, so any ids that spell
"Up,Left" count, and spaces are not allowed). A move
is Up/Down/Left/Right, up/down/left/right or U/D/L/R. The reply is the grid after the
turn's moves. A malformed turn (unknown word, too many moves, empty move, stray space)
executes no move, costs `format_penalty` and the reply is "invalid" above the unchanged
grid.

Dynamics (gym-sokoban, Schrader 2018, as RAGEN uses it): a move into a wall does
nothing; into a box pushes it one cell if the cell behind the box is floor or a target,
else does nothing. Every move, blocked or not, is a step. The episode terminates with
success as soon as every box is on a target; the rest of that turn's moves are ignored.

Reward per move (gym-sokoban's defaults, params as data):

    step_reward (−0.1) + box_on_reward (+1)·[boxes on targets went up]
      + box_off_reward (−1)·[went down] + success_reward (+10)·[all boxes on targets],

and a turn's reward is the sum over its executed moves (−format_penalty for a malformed
turn). `reward_bounds` bounds any turn of up to `max_actions_per_turn` moves.

Levels (gym-sokoban's reverse playing, in `lax.scan`): a room of `size` x `size` cells
(outer walls included, `size` a param up to the static `max_size`) with interior walls
drawn with probability `wall_prob`; `num_boxes` boxes start ON their targets. A first
box is placed with two free cells in a line beside it and is pulled once (the player
steps away from it dragging it along), so at least one box is off its target; then the
player takes `num_reverse_moves − 1` further random steps, pulling a box that lies
directly behind it with probability 1/2 (gym-sokoban's pull and plain move actions).
Every pull reversed is a push, so reversing the walk solves the level: every level is
solvable by construction. Like gym-sokoban, which searches reverse walks for the room
with the highest score, we score every state along `NUM_WALKS` = 8 independent walks by
the length of its reversed solution (shortest walks between the pushes) and keep the
longest one that has a box off target (so a level is never already solved).

Oracle: replays the reversed pulls. The walk's pulls are stored in the state as a plan
(box layout before each push, the box to push, the direction); from any state whose box
layout is one of the plan's, the oracle walks to the pushing position along a shortest
path (breadth-first distances in `lax.fori_loop`, boxes and walls blocking) and pushes.
It needs at most as many moves as the reverse walk took, so with `num_reverse_moves` ≤
`max_turns · max_actions_per_turn` (enforced by clipping) it solves every level within
the turn limit. We chose the replay over a breadth-first search of (player, boxes)
states because the state space grows as cells^(boxes + 1) and a static-shape BFS frontier
for several boxes is too heavy to run on every turn of a batched rollout; the replay is
exact by construction and costs a few small flood fills per move. It is not optimal.

Demonstrator: the oracle with each move replaced by a uniformly random one with
probability `noise`. A random push can take the boxes off the plan, after which it moves
at random (it has no solver), and random steps eat the turn budget. At the defaults (6 x 6
room, one box, 12 reverse moves, 4 turns of up to 3 moves) the oracle solves every level
(about 5.5 moves; a breadth-first search needs about 5.5 too) and the demonstrator about
70% of them (measured in the tests).

Process reward (`info["process_reward"]`, not part of the reward):

    (h(before) − h(after)) / h(start),   h = Σ_boxes Manhattan distance to the nearest target,

a standard Sokoban heuristic (walls ignored). It telescopes: a solved episode collects
exactly h(start)/h(start) = 1 (h = 0 when solved); pushing a box away from the targets
gives a negative value; walks and malformed turns give 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arl.text import chunks, parsing, turn_text
from arl.envs.base import (NON_NEGATIVE, ParamRange, TokenChunk, TokenEnvironment,
                           TokenEnvState)
from arl.text.codec import CharCodec, Codec

DIRECTIONS = ("Up", "Down", "Left", "Right")  # indices 0..3; d ^ 1 is the opposite
SYMBOLS = "#_OX*PS"  # wall, floor, target, box, box on target, player, player on target
WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = range(7)
SEPARATOR = ","
INVALID_TEXT = "invalid\n"
MIN_SIZE = 5  # a 3 x 3 interior: the smallest room with three free cells in a line
PULL_PROB = 0.5
NUM_WALKS = 8  # candidate reverse walks per level; the hardest is kept
_FAR = 10**6


@struct.dataclass
class SokobanParams:
    size: jax.Array  # int32, room side with its outer walls, clipped to [5, max_size]
    num_boxes: jax.Array  # int32, clipped to [1, max_boxes] (fewer only if a room is full)
    num_reverse_moves: jax.Array  # int32 random-walk length, clipped to [1, max_moves]
    wall_prob: jax.Array  # float32, probability of an interior wall per cell
    step_reward: jax.Array  # float32, every move (gym-sokoban: −0.1)
    box_on_reward: jax.Array  # float32, a box pushed onto a target (+1)
    box_off_reward: jax.Array  # float32, a box pushed off a target (−1)
    success_reward: jax.Array  # float32, all boxes on targets (+10)
    format_penalty: jax.Array  # float32, subtracted on a malformed turn


@struct.dataclass
class SokobanState(TokenEnvState):
    walls: jax.Array  # bool [max_size²], True outside the active room too
    targets: jax.Array  # bool [max_size²]
    boxes: jax.Array  # bool [max_size²]
    player: jax.Array  # int32, flat index (row · max_size + col)
    size: jax.Array  # int32, active room side
    # The reversed generation walk (see the module docstring), push j undoing pull j:
    plan_boxes: jax.Array  # bool [max_moves, max_size²], box layout before push j
    plan_cells: jax.Array  # int32 [max_moves], the box push j moves
    plan_dirs: jax.Array  # int32 [max_moves], the direction of push j
    plan_len: jax.Array  # int32, number of pushes (the pushes are j = plan_len-1, ..., 0)
    start_distance: jax.Array  # int32 h(start) >= 1, the process-reward scale
    moves: jax.Array  # int32, moves executed so far


class Sokoban(TokenEnvironment):
    """Sokoban on rooms of up to `max_size` x `max_size` cells (static, outer walls
    included) with up to `max_boxes` boxes; each turn carries up to
    `max_actions_per_turn` moves; episodes truncate after `max_turns` turns. The
    difficulty (room size, boxes, reverse-walk length, interior walls) is in the params."""

    name = "sokoban"

    def __init__(self, codec: Codec | None = None, max_size: int = 6, max_boxes: int = 2,
                 max_actions_per_turn: int = 3, max_turns: int = 4):
        if not isinstance(max_size, int) or not MIN_SIZE <= max_size <= 12:
            raise ValueError(f"max_size must be an int in [{MIN_SIZE}, 12], got {max_size!r}")
        if not isinstance(max_boxes, int) or not 1 <= max_boxes <= 4:
            raise ValueError(f"max_boxes must be an int in [1, 4], got {max_boxes!r}")
        if not isinstance(max_actions_per_turn, int) or not 1 <= max_actions_per_turn <= 10:
            raise ValueError(f"max_actions_per_turn must be an int in [1, 10], got "
                             f"{max_actions_per_turn!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        self.codec = codec or CharCodec()
        self.max_size = max_size
        self.max_boxes = max_boxes
        self.max_actions_per_turn = max_actions_per_turn
        self.max_turns = max_turns
        # The oracle needs at most num_reverse_moves moves, so this keeps it in budget.
        self.max_moves = max_turns * max_actions_per_turn
        self.num_cells = max_size * max_size
        self.grid_len = max_size * (max_size + 1) - 1
        enc = self.codec.encode
        self._symbol_ids = np.array([self.codec.token_id(s) for s in SYMBOLS], np.int32)
        self._newline = self.codec.token_id("\n")
        self._read = turn_text.TurnReader(self.codec)
        self._invalid_len = len(enc(INVALID_TEXT))
        self.prompt_len = self.grid_len
        self.obs_len = self._invalid_len + self.grid_len
        # Accepted spellings of each move, as text (the turn is read as text).
        self._patterns = [[turn_text.text_ids(d), turn_text.text_ids(d.lower()),
                           turn_text.text_ids(d[0])] for d in DIRECTIONS]
        word_len = max(len(enc(d)) for d in DIRECTIONS)
        self.action_len = max_actions_per_turn * (word_len + 1)  # words, commas, eot
        # Geometry tables (numpy constants folded into the programs).
        rows, cols = np.divmod(np.arange(self.num_cells), max_size)
        self._deltas = np.array([-max_size, max_size, -1, 1], np.int32)
        self._manhattan = (np.abs(rows[:, None] - rows[None, :])
                           + np.abs(cols[:, None] - cols[None, :])).astype(np.int32)
        self._rows, self._cols = rows.astype(np.int32), cols.astype(np.int32)

    def default_params(self, size: int | None = None, num_boxes: int = 1,
                       num_reverse_moves: int | None = None,
                       wall_prob: float = 0.1) -> SokobanParams:
        size = self.max_size if size is None else size
        num_reverse_moves = self.max_moves if num_reverse_moves is None else num_reverse_moves
        if not MIN_SIZE <= size <= self.max_size:
            raise ValueError(f"size must be in [{MIN_SIZE}, max_size={self.max_size}], got {size}")
        if not 1 <= num_boxes <= self.max_boxes:
            raise ValueError(f"num_boxes must be in [1, max_boxes={self.max_boxes}], got "
                             f"{num_boxes}")
        if not 1 <= num_reverse_moves <= self.max_moves:
            raise ValueError(f"num_reverse_moves must be in [1, max_turns * "
                             f"max_actions_per_turn = {self.max_moves}], got {num_reverse_moves}")
        if not 0.0 <= wall_prob < 1.0:
            raise ValueError(f"wall_prob must be in [0, 1), got {wall_prob}")
        f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
        return SokobanParams(
            size=jnp.asarray(size, jnp.int32), num_boxes=jnp.asarray(num_boxes, jnp.int32),
            num_reverse_moves=jnp.asarray(num_reverse_moves, jnp.int32),
            wall_prob=f32(wall_prob), step_reward=f32(-0.1), box_on_reward=f32(1.0),
            box_off_reward=f32(-1.0), success_reward=f32(10.0), format_penalty=f32(0.1))

    def param_ranges(self):
        """Room size, boxes and reverse-walk length up to the static bounds the buffers and
        the oracle's move budget were sized for; wall_prob in [0, 1); the move rewards may
        have either sign (gym-sokoban's step reward is negative), the format penalty is
        subtracted, so >= 0."""
        return dict(size=ParamRange(MIN_SIZE, self.max_size),
                    num_boxes=ParamRange(1, self.max_boxes),
                    num_reverse_moves=ParamRange(1, self.max_moves),
                    wall_prob=ParamRange(0.0, 1.0, high_open=True),
                    format_penalty=NON_NEGATIVE)

    def reward_bounds(self, params: SokobanParams):
        """Any turn: 1..K moves each in step + {0, on, off}, success at most once; or a
        malformed turn's −format_penalty."""
        k = self.max_actions_per_turn
        zero = jnp.zeros((), jnp.float32)
        move_low = params.step_reward + jnp.minimum(zero, jnp.minimum(params.box_on_reward,
                                                                      params.box_off_reward))
        move_high = params.step_reward + jnp.maximum(zero, jnp.maximum(params.box_on_reward,
                                                                       params.box_off_reward))
        turn_low = jnp.minimum(move_low, k * move_low) + jnp.minimum(zero, params.success_reward)
        turn_high = (jnp.maximum(move_high, k * move_high)
                     + jnp.maximum(zero, params.success_reward))
        return (jnp.minimum(turn_low, -params.format_penalty),
                jnp.maximum(turn_high, -params.format_penalty))

    # ------------------------------------------------------------------ levels
    def _interior(self, size: jax.Array) -> jax.Array:
        """bool [cells]: inside the outer walls of a `size` room."""
        rows, cols = jnp.asarray(self._rows), jnp.asarray(self._cols)
        return (rows >= 1) & (rows <= size - 2) & (cols >= 1) & (cols <= size - 2)

    def generate(self, key, params: SokobanParams):
        """A solvable level and its plan (see the module docstring), as a dict of the
        `SokobanState` fields."""
        n, m = self.num_cells, self.max_moves
        size = jnp.clip(params.size, MIN_SIZE, self.max_size).astype(jnp.int32)
        num_boxes = jnp.clip(params.num_boxes, 1, self.max_boxes)
        num_moves = jnp.clip(params.num_reverse_moves, 1, m)
        key_first, key_walls, key_boxes, key_walk = jax.random.split(key, 4)
        interior = self._interior(size)
        deltas = jnp.asarray(self._deltas)

        # The first box b and a direction d with b, b + d, b + 2d inside the room.
        cells = jnp.arange(n)
        near = jnp.clip(cells[:, None] + deltas[None, :], 0, n - 1)
        far = jnp.clip(cells[:, None] + 2 * deltas[None, :], 0, n - 1)
        # Row-wrapping of flat indices cannot fake a line: border cells are not interior.
        line_ok = interior[:, None] & interior[near] & interior[far]
        choice = jax.random.categorical(key_first, jnp.where(line_ok, 0.0, -jnp.inf).reshape(-1))
        first_box, first_dir = choice // 4, choice % 4
        reserved = (cells == first_box) | (cells == first_box + deltas[first_dir]) | (
            cells == first_box + 2 * deltas[first_dir])

        walls = ~interior | (jax.random.bernoulli(key_walls, params.wall_prob, (n,)) & ~reserved)
        free = ~walls & ~reserved
        boxes = cells == first_box
        if self.max_boxes > 1:
            score = jnp.where(free, jax.random.uniform(key_boxes, (n,)), -1.0)
            values, others = jax.lax.top_k(score, self.max_boxes - 1)
            keep = (values >= 0) & (jnp.arange(self.max_boxes - 1) < num_boxes - 1)
            boxes = boxes | jnp.any((cells[None, :] == others[:, None]) & keep[:, None], axis=0)
        targets = boxes

        # The first pull: the player steps from b + d to b + 2d dragging the box to b + d.
        player = (first_box + 2 * deltas[first_dir]).astype(jnp.int32)
        boxes = boxes.at[first_box].set(False).at[first_box + deltas[first_dir]].set(True)
        start = dict(
            boxes=boxes, player=player,
            plan_boxes=jnp.zeros((m, n), bool).at[0].set(boxes),
            plan_cells=jnp.zeros((m,), jnp.int32).at[0].set(first_box + deltas[first_dir]),
            plan_dirs=jnp.zeros((m,), jnp.int32).at[0].set(first_dir ^ 1),
            plan_len=jnp.ones((), jnp.int32),
            # Forward cost bookkeeping: `stand` is where the player stood right after the
            # latest pull (where the first forward push starts), `pushes_cost` the moves
            # that solve the level from there, `field` the distances to `stand`.
            stand=player, pushes_cost=jnp.ones((), jnp.int32),
            field=self.distance_to(walls | boxes, player))

        def scored(walk):
            """The walk's current state as a candidate level: its forward solution length
            (shortest walks between the reversed pulls); -1 when it is already solved."""
            cost = walk["field"][walk["player"]] + walk["pushes_cost"]
            unsolved = jnp.any(walk["boxes"] & ~targets)
            return dict(boxes=walk["boxes"], player=walk["player"], plan_len=walk["plan_len"],
                        score=jnp.where(unsolved, cost, -1).astype(jnp.int32))

        def reverse_step(carry, inputs):
            walk, best = carry
            index, key = inputs
            key_dir, key_pull = jax.random.split(key)
            direction = jax.random.randint(key_dir, (), 0, 4, jnp.int32)
            here = walk["player"]
            step_to = here + deltas[direction]
            behind = here - deltas[direction]
            moves = (index < num_moves - 1) & ~walls[step_to] & ~walk["boxes"][step_to]
            pulls = moves & walk["boxes"][behind] & jax.random.bernoulli(key_pull, PULL_PROB)
            boxes = jnp.where(pulls, walk["boxes"].at[behind].set(False).at[here].set(True),
                              walk["boxes"])
            j = walk["plan_len"]
            stand = jnp.where(pulls, step_to, walk["stand"]).astype(jnp.int32)
            walk = dict(
                boxes=boxes, player=jnp.where(moves, step_to, here).astype(jnp.int32),
                plan_boxes=jnp.where(pulls, walk["plan_boxes"].at[j].set(boxes),
                                     walk["plan_boxes"]),
                plan_cells=jnp.where(pulls, walk["plan_cells"].at[j].set(here),
                                     walk["plan_cells"]),
                plan_dirs=jnp.where(pulls, walk["plan_dirs"].at[j].set(direction ^ 1),
                                    walk["plan_dirs"]),
                plan_len=j + pulls.astype(jnp.int32),
                stand=stand,
                # The push undoing this pull, then the walk (in the layout before the pull,
                # where `field` was measured) to the previous pull's stand.
                pushes_cost=walk["pushes_cost"] + jnp.where(pulls, 1 + walk["field"][here], 0),
                field=self.distance_to(walls | boxes, stand))
            candidate = scored(walk)
            best = jax.tree.map(lambda a, b: jnp.where(candidate["score"] > best["score"], a, b),
                                candidate, best)
            return (walk, best), None

        def one_walk(key):
            (final, best), _ = jax.lax.scan(
                reverse_step, (start, scored(start)),
                (jnp.arange(m - 1), jax.random.split(key, m - 1)))
            return {**final, **best}

        walks = jax.vmap(one_walk)(jax.random.split(key_walk, NUM_WALKS))
        chosen = jax.tree.map(lambda x: x[jnp.argmax(walks["score"])], walks)
        return dict(walls=walls, targets=targets, boxes=chosen["boxes"],
                    player=chosen["player"], size=size, plan_boxes=chosen["plan_boxes"],
                    plan_cells=chosen["plan_cells"], plan_dirs=chosen["plan_dirs"],
                    plan_len=chosen["plan_len"])

    def box_distance(self, boxes: jax.Array, targets: jax.Array) -> jax.Array:
        """int32 h: sum over boxes of the Manhattan distance to the nearest target."""
        to_target = jnp.where(targets[None, :], jnp.asarray(self._manhattan), _FAR).min(axis=1)
        return jnp.sum(jnp.where(boxes, to_target, 0)).astype(jnp.int32)

    def _new_state(self, level: dict) -> SokobanState:
        false, zero = jnp.zeros((), bool), jnp.zeros((), jnp.int32)
        start = jnp.maximum(self.box_distance(level["boxes"], level["targets"]), 1)
        return SokobanState(turn=zero, terminated=false, truncated=false, success=false,
                            start_distance=start.astype(jnp.int32), moves=zero, **level)

    def level_state(self, text: str) -> SokobanState:
        """A state for a hand-written level (rows of the legend's symbols, surrounded by
        walls; at most max_size x max_size). It has no plan: the oracle only knows how to
        solve generated levels. Python-side helper (tests, demos), not jittable."""
        rows = text.strip("\n").split("\n")
        size = len(rows)
        if not all(len(r) == size for r in rows) or not MIN_SIZE <= size <= self.max_size:
            raise ValueError(f"text must be a square grid of side in [{MIN_SIZE}, "
                             f"{self.max_size}], got rows of lengths {[len(r) for r in rows]}")
        n, m = self.num_cells, self.max_moves
        walls, targets, boxes = np.ones(n, bool), np.zeros(n, bool), np.zeros(n, bool)
        players = []
        for r, line in enumerate(rows):
            for c, symbol in enumerate(line):
                if symbol not in SYMBOLS:
                    raise ValueError(f"unknown symbol {symbol!r} at row {r}, column {c}; "
                                     f"allowed: {SYMBOLS!r}")
                i = r * self.max_size + c
                kind = SYMBOLS.index(symbol)
                walls[i] = kind == WALL
                targets[i] = kind in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET)
                boxes[i] = kind in (BOX, BOX_ON_TARGET)
                if kind in (PLAYER, PLAYER_ON_TARGET):
                    players.append(i)
        border = np.zeros(n, bool)
        border[: size * self.max_size] = True
        inner = np.asarray(self._interior(jnp.asarray(size)))
        if len(players) != 1 or not np.all(walls[border & ~inner]) or boxes.sum() != targets.sum():
            raise ValueError("text needs exactly one player, walls all around and as many "
                             "targets as boxes")
        level = dict(walls=jnp.asarray(walls), targets=jnp.asarray(targets),
                     boxes=jnp.asarray(boxes), player=jnp.asarray(players[0], jnp.int32),
                     size=jnp.asarray(size, jnp.int32),
                     plan_boxes=jnp.zeros((m, n), bool), plan_cells=jnp.zeros((m,), jnp.int32),
                     plan_dirs=jnp.zeros((m,), jnp.int32), plan_len=jnp.zeros((), jnp.int32))
        return self._new_state(level)

    # -------------------------------------------------------------------- text
    def grid_chunk(self, state: SokobanState) -> TokenChunk:
        """The rendered active room, one row per line (see the legend)."""
        s = state.size
        here = jnp.arange(self.num_cells) == state.player
        symbol = jnp.select(
            [state.walls, here & state.targets, here, state.boxes & state.targets,
             state.boxes, state.targets],
            [WALL, PLAYER_ON_TARGET, PLAYER, BOX_ON_TARGET, BOX, TARGET], FLOOR)
        pos = jnp.arange(self.grid_len)
        row, col = pos // (s + 1), pos % (s + 1)
        cell = jnp.clip(row * self.max_size + col, 0, self.num_cells - 1)
        ids = jnp.where(col == s, self._newline, jnp.asarray(self._symbol_ids)[symbol[cell]])
        length = s * (s + 1) - 1
        ids = jnp.where(pos < length, ids, self.codec.pad_id)
        return TokenChunk(tokens=ids.astype(jnp.int32), length=length.astype(jnp.int32))

    # --------------------------------------------------------------- dynamics
    def _reset(self, key, params):
        state = self._new_state(self.generate(key, params))
        return state, self.grid_chunk(state)

    def move(self, walls, boxes, player, direction):
        """One gym-sokoban move: (boxes, player) after moving `direction` (blocked moves
        change nothing)."""
        delta = jnp.asarray(self._deltas)[direction]
        step_to = player + delta
        beyond = jnp.clip(step_to + delta, 0, self.num_cells - 1)
        pushes = boxes[step_to]
        blocked = walls[step_to] | (pushes & (walls[beyond] | boxes[beyond]))
        moved_boxes = jnp.where(pushes, boxes.at[step_to].set(False).at[beyond].set(True), boxes)
        return (jnp.where(blocked, boxes, moved_boxes),
                jnp.where(blocked, player, step_to).astype(jnp.int32))

    def parse_moves(self, content: TokenChunk):
        """(directions int32 [K], count int32, valid bool) of "Move,Move,...": 1..K
        comma-separated moves, each one of the accepted spellings."""
        k = self.max_actions_per_turn
        text = self._read(content)
        starts, ends, count = parsing.split_args(text.tokens, 0, text.length,
                                                 turn_text.text_id(SEPARATOR), k)
        hits = jnp.stack([
            jnp.stack([jnp.any(jnp.stack([parsing.range_equals(text.tokens, starts[i],
                                                               ends[i], p) for p in patterns]))
                       for patterns in self._patterns])
            for i in range(k)])  # [K, 4]
        used = jnp.arange(k) < count
        valid = (count <= k) & jnp.all(jnp.any(hits, axis=1) | ~used)
        return jnp.argmax(hits, axis=1).astype(jnp.int32), count, valid

    def _transition(self, key, state, content: TokenChunk, params):
        del key
        directions, count, valid = self.parse_moves(content)

        def one_move(carry, inputs):
            boxes, player, solved, moves = carry
            index, direction = inputs
            live = valid & (index < count) & ~solved
            new_boxes, new_player = self.move(state.walls, boxes, player, direction)
            on_before = jnp.sum(boxes & state.targets)
            on_after = jnp.sum(new_boxes & state.targets)
            done = ~jnp.any(new_boxes & ~state.targets)
            reward = (params.step_reward + params.box_on_reward * (on_after > on_before)
                      + params.box_off_reward * (on_after < on_before)
                      + params.success_reward * done)
            carry = (jnp.where(live, new_boxes, boxes), jnp.where(live, new_player, player),
                     solved | (live & done), moves + live.astype(jnp.int32))
            return carry, jnp.where(live, reward, 0.0)

        init = (state.boxes, state.player, jnp.zeros((), bool), state.moves)
        (boxes, player, solved, moves), rewards = jax.lax.scan(
            one_move, init, (jnp.arange(self.max_actions_per_turn), directions))
        new_state = state.replace(boxes=boxes, player=player, moves=moves,
                                  terminated=solved, success=solved)
        reward = jnp.where(valid, jnp.sum(rewards), -params.format_penalty)
        grid = self.grid_chunk(new_state)
        invalid = chunks.constant_chunk(self.codec, INVALID_TEXT, self._invalid_len)
        with_prefix = chunks.concat_chunks(invalid, grid, self.obs_len, self.codec.pad_id)
        plain = chunks.pad_chunk(grid, self.obs_len, self.codec.pad_id)
        observation = jax.tree.map(lambda a, b: jnp.where(valid, a, b), plain, with_prefix)
        return new_state, observation, reward.astype(jnp.float32), ~valid

    def process_reward(self, old_state: SokobanState, new_state: SokobanState,
                       params) -> jax.Array:
        """(h(before) − h(after)) / h(start), h the summed box-to-nearest-target distance."""
        del params
        before = self.box_distance(old_state.boxes, old_state.targets)
        after = self.box_distance(new_state.boxes, new_state.targets)
        scale = jnp.maximum(old_state.start_distance, 1).astype(jnp.float32)
        return ((before - after).astype(jnp.float32) / scale).astype(jnp.float32)

    # --------------------------------------------------------------- teachers
    def distance_to(self, blocked: jax.Array, goal: jax.Array) -> jax.Array:
        """int32 [cells]: shortest number of moves to `goal` avoiding `blocked` cells
        (_FAR where unreachable), by relaxation over the grid."""
        s = self.max_size
        grid_blocked = blocked.reshape(s, s)
        dist = jnp.where(jnp.arange(self.num_cells) == goal, 0, _FAR).reshape(s, s)

        def relax(_, d):
            padded = jnp.pad(d, 1, constant_values=_FAR)
            best = jnp.minimum(jnp.minimum(padded[:-2, 1:-1], padded[2:, 1:-1]),
                               jnp.minimum(padded[1:-1, :-2], padded[1:-1, 2:]))
            return jnp.where(grid_blocked, _FAR, jnp.minimum(d, best + 1))

        # A shortest path visits each interior cell at most once.
        return jax.lax.fori_loop(0, (s - 2) * (s - 2), relax, dist).reshape(-1)

    def plan_direction(self, state: SokobanState, boxes, player):
        """(direction, on_plan): the oracle's next move from (boxes, player). on_plan is
        False when the box layout is not one of the plan's (the oracle is lost)."""
        deltas = jnp.asarray(self._deltas)
        matches = (jnp.all(state.plan_boxes == boxes[None, :], axis=1)
                   & (jnp.arange(self.max_moves) < state.plan_len))
        # The earliest pull with this layout is the fewest pushes away from solved.
        j = jnp.argmax(matches)
        push_dir = state.plan_dirs[j]
        stand = state.plan_cells[j] - deltas[push_dir]
        dist = self.distance_to(state.walls | boxes, stand)
        neighbours = jnp.clip(player + deltas, 0, self.num_cells - 1)
        walk_dir = jnp.argmin(dist[neighbours]).astype(jnp.int32)
        direction = jnp.where(player == stand, push_dir, walk_dir)
        return direction.astype(jnp.int32), jnp.any(matches)

    def scripted_moves(self, key, state: SokobanState, noise=0.0):
        """(directions int32 [K], count): up to K moves of the plan follower, each
        replaced by a random move with probability `noise`; it stops once solved."""
        def one(carry, key):
            boxes, player, count, solved = carry
            key_coin, key_dir = jax.random.split(key)
            direction, on_plan = self.plan_direction(state, boxes, player)
            random_dir = jax.random.randint(key_dir, (), 0, 4, jnp.int32)
            noisy = (jax.random.uniform(key_coin) < noise) | ~on_plan
            direction = jnp.where(noisy, random_dir, direction)
            new_boxes, new_player = self.move(state.walls, boxes, player, direction)
            live = ~solved
            done = ~jnp.any(new_boxes & ~state.targets)
            carry = (jnp.where(live, new_boxes, boxes), jnp.where(live, new_player, player),
                     count + live.astype(jnp.int32), solved | done)
            return carry, direction

        solved = ~jnp.any(state.boxes & ~state.targets)
        init = (state.boxes, state.player, jnp.zeros((), jnp.int32), solved)
        (_, _, count, _), directions = jax.lax.scan(
            one, init, jax.random.split(key, self.max_actions_per_turn))
        return directions, jnp.maximum(count, 1)

    def moves_chunk(self, directions: jax.Array, count: jax.Array) -> TokenChunk:
        """"Up,Left<eot>" for the first `count` of `directions`."""
        turns = ([self.codec.encode(d + SEPARATOR) for d in DIRECTIONS]
                 + [chunks.with_eot(self.codec, d) for d in DIRECTIONS])
        width = self.action_len
        pieces = []
        for i in range(self.max_actions_per_turn):
            last = (i == count - 1).astype(jnp.int32)
            piece = chunks.select_ids(self.codec, directions[i] + 4 * last, turns, width)
            pieces.append(piece.replace(length=jnp.where(i < count, piece.length, 0)))
        return chunks.concat_all(pieces, width, self.codec.pad_id)

    def oracle_action(self, key, state: SokobanState, params) -> TokenChunk:
        """The reversed generation walk with shortest walks between pushes."""
        del params
        return self.moves_chunk(*self.scripted_moves(key, state))

    def demonstrator_action(self, key, state: SokobanState, params,
                            noise: float = 0.4) -> TokenChunk:
        """A weaker teacher: each oracle move is a uniformly random one with probability
        `noise`; off the plan it only moves at random."""
        del params
        return self.moves_chunk(*self.scripted_moves(key, state, noise))
