"""OpenEnv environments as arl environments: `config.env.name = "openenv:<url or module>"`.

    c.env.name = "openenv:http://127.0.0.1:8000"        # a server already running
    c.env.name = "openenv:my_package.server.app:app"    # an app arl serves itself
    c.env.kwargs.action_parser = "my_package.parsing:guess_action"

OpenEnv (`pip install 'arl[openenv]'`, tested with openenv-core 0.3.0) serves an
environment over a WebSocket: each connection is one session holding its own
environment instance on the server. So every episode is one session of a
`SessionEnvironment` (`arl.envs.sessions`): a client connection opened and reset with
the episode's seed when its row is reset, stepped with each of the agent's turns, closed
when the episode ends. What maps to what:

* the server: a URL (`http(s)://` or `ws(s)://`), or `<module>:<attribute>` (default
  attribute `app`) naming the FastAPI app of OpenEnv's `create_app(Env, Action,
  Observation, max_concurrent_envs=...)`, which arl serves on a free local port with
  uvicorn, in a daemon thread of this process (until it ends), without Docker. Its `max_concurrent_envs` must
  hold the rows of a batch (a row past it gets the server's capacity error).
* action: the agent's turn (text) goes through a declared parser, `action_parser`
  ("module:function", text -> the action's fields as a dict, or an OpenEnv `Action`),
  or by default `{action_key: text}`. A parser that raises ValueError (or TypeError,
  KeyError) makes the turn a format error: the reply is "invalid action: <its message>"
  and the server is not called.
* observation: the reset's and each step's observation, as the text of its field
  `observation_key`, or by default all its fields as compact JSON.
* reward: the step's reward (None: 0); `done` terminates the episode; success: a
  finished episode whose last reward is at least `success_reward`.
* resume and branching: `deterministic=False` by default (resume mode "restart"): a
  server's environment is not known to replay; say `deterministic=True` for one whose
  reset(seed) and steps are deterministic.
* errors: a server error (the environment raised, capacity reached, the connection
  dropped) ends that row's episode with a "host error" reply and one log line naming
  it; the other rows play on. A server that cannot be reached, a module that cannot be
  imported or a parser that does not exist is a one-line configuration error.

Not mapped: OpenEnv's MCP tool mode, its Docker and Hugging Face Hub providers (start
the container yourself and give its URL), typed clients (the generic client sends
dicts), and an oracle or demonstrator (an OpenEnv environment declares none).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import socket
import threading
import time
import urllib.request
from typing import Any, Callable

import jax.numpy as jnp

from arl.envs.host import HostTurn
from arl.envs.sessions import EpisodeKey, SessionEnvironment
from arl.errors import one_line
from arl.text.codec import CharCodec, Codec

PREFIX = "openenv"
_URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
_PARSE_ERRORS = (ValueError, TypeError, KeyError)


def _library():
    try:
        import openenv.core  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        raise ValueError("env 'openenv:<url or module>' needs the openenv-core package: "
                         "pip install 'arl[openenv]'") from error
    return openenv.core


def _resolve(path: str, default_attribute: str | None, what: str):
    """The object `module:attribute` names (ValueError in one line otherwise)."""
    module_name, _, attribute = path.partition(":")
    attribute = attribute or default_attribute
    if not module_name or not attribute:
        raise ValueError(f"{what} {path!r} must be 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # pylint: disable=broad-except
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r}: "
                         f"{type(error).__name__}: {one_line(error)}") from error
    if not hasattr(module, attribute):
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no {attribute!r}")
    return getattr(module, attribute)


class _LocalServer:
    """A FastAPI app served by uvicorn on a free port of 127.0.0.1, in a daemon thread."""

    def __init__(self, app, timeout_s: float = 30.0):
        import uvicorn  # pylint: disable=import-outside-toplevel

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        # uvicorn's own log is silenced: with openenv-core 0.3.0 every session a client
        # closes logs "Exception in ASGI application" and a traceback (the server closes
        # a socket the client already closed); what the environment raises reaches the
        # row as a server error instead.
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True,
                                       name=f"openenv-server-{port}")
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ValueError(f"the OpenEnv app did not start serving on {self.url}")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5.0)


class _Loop:
    """One asyncio event loop in a daemon thread: every session's client runs on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="openenv-clients")
        self.thread.start()

    def run(self, coroutine, timeout_s: float | None):
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout_s)
        except BaseException:
            future.cancel()  # a call past its time limit stops waiting on the server
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5.0)


def _reachable(url: str, timeout_s: float) -> None:
    http = "http" + url[2:] if url.startswith("ws") else url
    try:
        with urllib.request.urlopen(f"{http.rstrip('/')}/health", timeout=timeout_s):
            pass
    except Exception as error:  # pylint: disable=broad-except
        raise ValueError(f"the OpenEnv server at {url!r} cannot be reached: "
                         f"{type(error).__name__}: {one_line(error)}") from error


class OpenEnvEnvironment(SessionEnvironment):
    """An OpenEnv environment, a client session per episode (module docstring)."""

    def __init__(self, target: str, action_key: str = "message",
                 action_parser: str | None = None, observation_key: str | None = None,
                 success_reward: float = 1.0, reward_range: tuple = (0.0, 1.0),
                 max_turns: int = 8, action_len: int = 32, prompt_len: int = 128,
                 obs_len: int = 64, deterministic: bool = False, codec: Codec | None = None,
                 max_sessions: int = 1024, step_timeout_s: float | None = 60.0,
                 connect_timeout_s: float = 10.0):
        core = _library()
        self.name = f"{PREFIX}:{target}"
        for field, value in (("max_turns", max_turns), ("action_len", action_len),
                             ("prompt_len", prompt_len), ("obs_len", obs_len),
                             ("max_sessions", max_sessions)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}={value!r} must be an int >= 1")
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic={deterministic!r} must be True or False")
        low, high = (float(v) for v in reward_range)
        if not low <= high:
            raise ValueError(f"reward_range={tuple(reward_range)!r} must be (low, high) "
                             "with low <= high")
        self.reward_range = (low, high)
        self.parse = (_resolve(action_parser, None, "action_parser") if action_parser
                      else functools.partial(_field_action, action_key))
        if not callable(self.parse):
            raise ValueError(f"action_parser {action_parser!r} is not callable")
        self.observation_key = observation_key
        self.success_reward = float(success_reward)
        self.deterministic = deterministic
        self.codec = codec if codec is not None else CharCodec()
        self.max_turns, self.action_len = max_turns, action_len
        self.prompt_len, self.obs_len = prompt_len, obs_len
        self.max_sessions, self.step_timeout_s = max_sessions, step_timeout_s
        self.connect_timeout_s = float(connect_timeout_s)
        self._client_class = core.GenericEnvClient
        self._server = None
        if target.startswith(_URL_SCHEMES):
            self.url = target
        else:
            app = _resolve(target, "app", "OpenEnv app")
            self._server = _LocalServer(app)
            self.url = self._server.url
        _reachable(self.url, self.connect_timeout_s)
        self._loop_lock = threading.Lock()
        self._client_loop = None

    @property
    def _loop(self) -> _Loop:
        """The clients' event loop (started on first use, again after `close`)."""
        with self._loop_lock:
            if self._client_loop is None:
                self._client_loop = _Loop()
            return self._client_loop

    def default_params(self):
        return ()

    def reward_bounds(self, params):
        low, high = self.reward_range
        return jnp.asarray(min(low, 0.0), jnp.float32), jnp.asarray(max(high, 0.0),
                                                                   jnp.float32)

    def _text(self, observation: dict) -> str:
        if self.observation_key is not None:
            return str(observation.get(self.observation_key, ""))
        return json.dumps(observation, sort_keys=True, separators=(",", ":"))

    # -- sessions
    def open_session(self, key: EpisodeKey, params):
        client = self._client_class(base_url=self.url,
                                    connect_timeout_s=self.connect_timeout_s,
                                    message_timeout_s=self.step_timeout_s or 3600.0)
        try:
            self._loop.run(client.connect(), self.step_timeout_s)
            result = self._loop.run(client.reset(seed=int(key.seed % 2 ** 31)),
                                    self.step_timeout_s)
        except BaseException:
            self._close_client(client)
            raise
        return client, self._text(result.observation or {})

    def session_step(self, session, action: str, rng) -> HostTurn:
        del rng
        try:
            payload = self.parse(action)
            if hasattr(payload, "model_dump"):
                payload = payload.model_dump()
            if not isinstance(payload, dict):
                raise TypeError(f"the parser returned {type(payload).__name__}, not a dict")
        except _PARSE_ERRORS as error:
            return HostTurn(reply=f"invalid action: {one_line(error)}", format_error=True)
        result = self._loop.run(session.step(payload), self.step_timeout_s)
        reward = float(result.reward) if result.reward is not None else 0.0
        done = bool(result.done)
        return HostTurn(reply=self._text(result.observation or {}), reward=reward,
                        terminated=done, success=done and reward >= self.success_reward)

    def close_session(self, session) -> None:
        self._close_client(session)

    def _close_client(self, client) -> None:
        try:
            self._loop.run(client.close(), 5.0)
        except Exception:  # pylint: disable=broad-except
            pass  # a connection that fails to close is gone anyway

    def close(self) -> None:
        """Closes every session and the clients' loop (a server arl started serves on,
        in its daemon thread, until the process ends)."""
        super().close()
        with self._loop_lock:
            loop, self._client_loop = self._client_loop, None
        if loop is not None:
            loop.close()


def _field_action(key: str, text: str) -> dict:
    return {key: text}


def factory(target: str) -> Callable[..., Any]:
    """What "openenv:<url or module>" builds (ValueError: no library, an empty target)."""
    _library()
    if not target:
        raise ValueError("env 'openenv:<url or module>' needs a server URL or an app's "
                         "'module:attribute' after the colon")
    return functools.partial(OpenEnvEnvironment, target)
