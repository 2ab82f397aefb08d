"""Stateful host environments: one Python session per episode, opened, stepped, closed.

The host contract (`arl.envs.host`) keeps nothing on the host between calls: the task
is re-derived from its seed. Browser, shell, game and remote environments hold a
session instead (a process, a connection, a game object). `SessionEnvironment` is a
`HostEnvironment` for them; a subclass implements, on the host:

    open_session(key: EpisodeKey, params) -> (session, prompt text)   # at reset
    session_step(session, action: str, rng) -> HostTurn               # each live turn
    close_session(session)                                            # optional
    session_oracle(session) -> str                                    # optional
    session_demonstrator(session, rng) -> str                         # optional
    deterministic: bool   # the same seed and actions give the same episode

The episode's identity (`EpisodeKey`): its task seed (shared by the rows of a GRPO
group, a function of the reset key) and a session id unique in the process (held in
the row's `memory["session"]`, so it travels with the JAX state). A session is opened
when its row is reset and closed when its episode ends: terminated, truncated at
`max_turns`, a turn that raised (the row gets "host error"), or ran past
`step_timeout_s` (closed once the abandoned call returns).

Sessions live in a bounded pool (`max_sessions`, least recently used first out; an
evicted session is closed). Errors are per row: a session that fails to open, a step
that raises or times out, a row whose session is gone, each ends that row's episode
with a "host error" reply; the other rows play on.

Modes, for what a pure state pytree gave for free (`deterministic`):

* ``deterministic = True`` ("replay"): every session's actions are recorded. A row whose
  session does not match its state (a Monte Carlo branch, `arl.rollout.branching`,
  forked from a mid-episode state; a session evicted from the pool) gets a fresh session
  of the same seed with the recorded actions of its first `turn` turns replayed, then
  plays on. A resumed run (after a kill at any moment) replays its steps from the
  checkpoint, and the episodes in flight with them: the same tasks, the same turns.
* ``deterministic = False`` ("restart"): nothing can be replayed. A resumed run starts
  the episodes that were in flight afresh (new sessions of the same seeds); Monte Carlo
  branching is refused when the trainer is built (one line naming
  `config.process.mc_samples`), and a row whose session is gone ends with a "host
  error" reply.

Sessions never outlive the process (they are not in checkpoints): a train step opens
and ends its episodes, so a checkpoint never holds an episode in flight.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import OrderedDict
from typing import Any

from arl.envs.host import HostEnvironment, HostEpisode, HostTurn
from arl.errors import ConfigError

SESSION_FIELD = "session"  # the memory field holding the row's session id (0: none)
RESUME_MODES = {True: "replay", False: "restart"}


@dataclasses.dataclass(frozen=True)
class EpisodeKey:
    """The identity of one episode: its task seed (the rows of a group share it) and its
    session id (unique in the process)."""

    seed: int
    session_id: int


@dataclasses.dataclass
class _Session:
    key: EpisodeKey
    handle: Any
    params: Any
    turn: int = 0  # turns played in this session
    abandoned: bool = False  # a step ran past the time limit: close when it returns


class SessionGone(RuntimeError):
    """A row's session is not in the pool (evicted, or its reset failed)."""


class SessionEnvironment(HostEnvironment):
    """A host environment holding one session per episode (module docstring).

    Static attributes besides `HostEnvironment`'s: `deterministic` (the resume and
    branching mode) and `max_sessions` (the pool's bound).
    """

    memory_fields = (SESSION_FIELD,)
    deterministic: bool = False
    max_sessions: int = 1024

    # -- the subclass's hooks (plain Python)
    def open_session(self, key: EpisodeKey, params) -> tuple[Any, str]:
        """(session, prompt text) of a new episode; deterministic in `key.seed` when
        `deterministic`."""
        raise NotImplementedError

    def session_step(self, session, action: str, rng: random.Random) -> HostTurn:
        raise NotImplementedError

    def close_session(self, session) -> None:
        """Releases a session (default: nothing)."""
        del session

    def session_oracle(self, session) -> str:
        raise NotImplementedError

    def session_demonstrator(self, session, rng: random.Random) -> str:
        """A weaker teacher's turn (default: the oracle's)."""
        del rng
        return self.session_oracle(session)

    @property
    def resume_mode(self) -> str:
        """"replay" (deterministic) or "restart" (module docstring)."""
        return RESUME_MODES[bool(self.deterministic)]

    @property
    def has_oracle(self) -> bool:
        return type(self).session_oracle is not SessionEnvironment.session_oracle

    @property
    def has_demonstrator(self) -> bool:
        return (type(self).session_demonstrator is not SessionEnvironment.session_demonstrator
                or self.has_oracle)

    # -- the pool
    def _sessions_init(self):
        self._host_init()
        if getattr(self, "_sessions_ready", False):
            return
        with self._lock:
            if getattr(self, "_sessions_ready", False):
                return
            self._sessions: OrderedDict[int, _Session] = OrderedDict()
            self._actions: OrderedDict[int, list[str]] = OrderedDict()  # replay logs
            self._next_id = 1
            self._opening = threading.local()
            self.session_counts = {"opened": 0, "closed": 0, "evicted": 0, "replayed": 0}
            self._sessions_ready = True

    def live_sessions(self) -> int:
        self._sessions_init()
        with self._lock:
            return len(self._sessions)

    def _open(self, seed: int, params) -> tuple[_Session, str]:
        with self._lock:
            session_id = self._next_id
            self._next_id += 1
        key = EpisodeKey(seed=seed, session_id=session_id)
        handle, prompt = self.open_session(key, params)
        record = _Session(key=key, handle=handle, params=params)
        evicted = []
        with self._lock:
            self._sessions[session_id] = record
            if self.deterministic:
                self._actions[session_id] = []
                while len(self._actions) > 4 * max(self.max_sessions, 1):
                    self._actions.popitem(last=False)
            self.session_counts["opened"] += 1
            while len(self._sessions) > max(self.max_sessions, 1):
                evicted.append(self._sessions.popitem(last=False)[1])
                self.session_counts["evicted"] += 1
        for old in evicted:
            self._close(old, counted=False)
        return record, prompt

    def _close(self, record: _Session, counted: bool = True) -> None:
        with self._lock:
            if self._sessions.get(record.key.session_id) is record:
                del self._sessions[record.key.session_id]
            if counted:
                self.session_counts["closed"] += 1
        try:
            self.close_session(record.handle)
        except Exception:  # pylint: disable=broad-except
            pass  # a session that fails to close is gone anyway

    def close(self) -> None:
        """Closes every session and the worker pool."""
        self._sessions_init()
        with self._lock:
            records = list(self._sessions.values())
        for record in records:
            self._close(record)
        super().close()

    # -- the stateless hooks, in terms of sessions
    def make_task(self, seed: int, params) -> int:
        return seed  # the session holds the task

    def prompt(self, task, params) -> str:
        # `_host_reset` calls prompt(task, params) and then initial_memory(task, params)
        # for each row, in one thread: the session opened here is registered there.
        self._sessions_init()
        record, text = self._open(int(task), params)
        self._opening.record = record
        return text

    def initial_memory(self, task, params) -> dict:
        record = getattr(self._opening, "record", None)
        self._opening.record = None
        return {SESSION_FIELD: 0 if record is None else record.key.session_id}

    def _session_of(self, episode: HostEpisode) -> tuple[_Session, dict]:
        """The row's session, replayed into a fresh one where it does not match the
        row's state (deterministic mode); the memory change that names it."""
        session_id = episode.memory.get(SESSION_FIELD, 0)
        with self._lock:
            record = self._sessions.get(session_id)
            if record is not None:
                self._sessions.move_to_end(session_id)
            log = list(self._actions.get(session_id, ()))
        if record is not None and record.turn == episode.turn and not record.abandoned:
            return record, {}
        if session_id == 0:
            raise SessionGone("no session: its reset failed")
        if not self.deterministic or len(log) < episode.turn:
            why = ("its episode was forked or its session evicted, and the env is not "
                   "deterministic (resume mode 'restart')" if not self.deterministic else
                   "its recorded actions are no longer kept")
            raise SessionGone(f"session {session_id} is gone: {why}")
        fresh, _ = self._open(int(episode.seed), episode.params)
        for action in log[:episode.turn]:
            self._played(fresh, action, self.session_step(fresh.handle, action,
                                                          random.Random(0)))
        with self._lock:
            self.session_counts["replayed"] += 1
        return fresh, {SESSION_FIELD: fresh.key.session_id}

    def _played(self, record: _Session, action: str, turn: HostTurn) -> None:
        record.turn += 1
        if self.deterministic:
            with self._lock:
                self._actions.setdefault(record.key.session_id, []).append(action)

    def host_step(self, episode: HostEpisode, action: str) -> HostTurn:
        self._sessions_init()
        record, memory = self._session_of(episode)
        start = time.monotonic()
        try:
            turn = self.session_step(record.handle, action, episode.rng())
        except Exception:
            self._close(record)
            raise
        self._played(record, action, turn)
        late = self.step_timeout_s is not None and \
            time.monotonic() - start >= self.step_timeout_s
        ends = (not isinstance(turn, HostTurn) or turn.terminated or turn.host_error
                or episode.turn + 1 >= self.max_turns)
        if late or ends:  # late: the row already ended with "timeout"
            self._close(record)
        if memory and isinstance(turn, HostTurn):
            turn = dataclasses.replace(turn, memory={**(turn.memory or {}), **memory})
        return turn

    def _scripted_turn(self, episode: HostEpisode, play) -> str:
        self._sessions_init()
        record, replayed = self._session_of(episode)
        try:
            return play(record.handle)
        finally:
            if replayed:  # the row's state cannot name it (a policy returns no memory)
                self._close(record)

    def host_oracle(self, episode: HostEpisode) -> str:
        return self._scripted_turn(episode, self.session_oracle)

    def host_demonstrator(self, episode: HostEpisode, rng: random.Random) -> str:
        return self._scripted_turn(episode,
                                   lambda session: self.session_demonstrator(session, rng))


def check_branching(env, branch_turns, mc_samples: int = 1) -> None:
    """Refuses Monte Carlo branching (`process.mc_samples` > 0, forking before
    `branch_turns`) on a session env that cannot replay, in one line."""
    members = getattr(env, "envs", (env,))
    for member in members:
        inner = getattr(member, "env", member)  # a wrapper's env
        if branch_turns and isinstance(inner, SessionEnvironment) and \
                not inner.deterministic:
            raise ConfigError(
                f"config.process.mc_samples={mc_samples!r} is invalid: Monte Carlo "
                f"branching forks mid-episode states (before turns {tuple(branch_turns)}), "
                f"and env {inner.name!r} holds a session per episode and is not "
                "deterministic (resume mode 'restart'); use process.mc_samples=0, or make "
                "the env deterministic given its seed (deterministic = True: replay)")
