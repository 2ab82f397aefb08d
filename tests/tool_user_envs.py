"""A user's own tool environment, defined outside `arl` and registered on import.

`warehouse`: "How many units of widget are in warehouse 2, and what do 3 of them cost in
EUR?". Two tools of several typed arguments, declared as decorated methods:
`stock(item: str, warehouse: int)` and `price(item: str, quantity: int, currency:
"EUR" | "USD", gift_wrap: bool = False)`. The oracle calls both in ONE turn, then
answers `<answer>units;cost</answer>`. tests/tool_env_config.py trains it through the
CLI from a checkpoint (`config.imports = ("tests.tool_user_envs",)`); tests/
test_declared_tools.py checks its contexts against `apply_chat_template`.
"""

from __future__ import annotations

import random
import re
from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct

from arl import envs
from arl.envs.base import NON_NEGATIVE
from arl.envs.host import HostEpisode, HostTurn
from arl.envs.tool_calling import ToolCallingEnvironment, tool

ITEMS = ("widget", "gadget", "sprocket", "flange")
UNIT_CENTS = {"widget": 250, "gadget": 1200, "sprocket": 75, "flange": 430}
USD_PER_EUR = 1.25


@struct.dataclass
class WarehouseParams:
    success_reward: jax.Array  # float32 []


class Warehouse(ToolCallingEnvironment):
    """The user env of the module docstring."""

    name = "warehouse"
    memory_fields = ("looked_up",)

    def __init__(self, codec=None, max_turns: int = 2, obs_len: int = 48,
                 action_len: int = 256, max_invalid_calls: int = 2,
                 max_calls_per_turn: int | None = None):
        super().__init__(codec=codec, max_turns=max_turns, prompt_len=48, obs_len=obs_len,
                         action_len=action_len, max_invalid_calls=max_invalid_calls,
                         max_calls_per_turn=max_calls_per_turn)

    @tool
    def stock(self, episode: HostEpisode, item: str, warehouse: int) -> HostTurn:
        """Units of an item in stock.

        Args:
          item: the item's name.
          warehouse: the warehouse number, 1 to 3.
        """
        if item not in ITEMS or not 1 <= warehouse <= 3:
            raise KeyError(f"no {item!r} in warehouse {warehouse}")
        units = _units(episode.seed, item, warehouse)
        return HostTurn(reply=str(units), memory={"looked_up": 1})

    @tool
    def price(self, episode: HostEpisode, item: str, quantity: int,
              currency: Literal["EUR", "USD"], gift_wrap: bool = False) -> str:
        """Price of an order, in whole units of the currency (rounded down).

        Args:
          item: the item's name.
          quantity: how many units.
          currency: the currency of the price.
          gift_wrap: wrap each unit (1 more per unit).
        """
        del episode
        if item not in ITEMS:
            raise KeyError(f"no item {item!r}")
        return str(_cost(item, quantity, currency, gift_wrap))

    # -- the task
    def default_params(self) -> WarehouseParams:
        return WarehouseParams(success_reward=jnp.asarray(1.0, jnp.float32))

    def param_ranges(self):
        return {"success_reward": NON_NEGATIVE}

    def reward_bounds(self, params: WarehouseParams):
        return -self.invalid_call_penalty, params.success_reward

    def make_task(self, seed: int, params):
        del params
        rng = random.Random(seed)
        item, warehouse = rng.choice(ITEMS), rng.randint(1, 3)
        quantity, currency = rng.randint(2, 9), rng.choice(("EUR", "USD"))
        units = _units(seed, item, warehouse)
        return dict(item=item, warehouse=warehouse, quantity=quantity, currency=currency,
                    answer=f"{units};{_cost(item, quantity, currency, False)}")

    def prompt(self, task, params) -> str:
        del params
        return (f"Units of {task['item']} in warehouse {task['warehouse']}, and the cost of "
                f"{task['quantity']} in {task['currency']}?")

    def host_answer(self, episode: HostEpisode, text: str) -> HostTurn:
        match = re.fullmatch(r"\s*<answer>(.*)</answer>\s*", text, re.S)
        if match is None:
            return HostTurn(reply="error: no tool call or answer",
                            reward=-self.invalid_call_penalty, format_error=True)
        correct = match.group(1).strip() == episode.task["answer"]
        return HostTurn(reply="correct" if correct else "wrong",
                        reward=float(episode.params.success_reward) * correct,
                        terminated=True, success=correct)

    def host_oracle(self, episode: HostEpisode) -> str:
        """Both tools in one turn (one a turn where the template renders one), then the
        answer."""
        task = episode.task
        calls = [("stock", {"item": task["item"], "warehouse": task["warehouse"]}),
                 ("price", {"item": task["item"], "quantity": task["quantity"],
                            "currency": task["currency"], "gift_wrap": False})]
        done = episode.memory.get("tool_calls", 0)
        if done >= len(calls):
            return f"<answer>{task['answer']}</answer>"
        return self.calls_text(*(calls[done:] if self.max_calls_per_turn > 1 else
                                 calls[done:done + 1]))


def _units(seed: int, item: str, warehouse: int) -> int:
    return random.Random(f"{seed}:{item}:{warehouse}").randint(0, 500)


def _cost(item: str, quantity: int, currency: str, gift_wrap: bool) -> int:
    cents = (UNIT_CENTS[item] + 100 * bool(gift_wrap)) * quantity
    return int(cents * (USD_PER_EUR if currency == "USD" else 1.0)) // 100


envs.register("warehouse", Warehouse)
