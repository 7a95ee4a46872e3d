"""Built-in environments and their task generators (``[data] generator``).

- ``GuessNumber``: a text game. The model guesses a secret number; after each wrong guess the
  environment answers "higher" or "lower". Success (1.0) is guessing it within the turns. A
  random policy almost never answers with a number; an RL-trained one learns to, and to use
  the answers.
- ``Calculator``: a tool-use episode. The model may call ``calc`` (OpenAI/Hermes tool-call
  format, ``<tool_call>{"name": "calc", "arguments": {"expression": "12*7"}}</tool_call>``),
  gets the result as a ``tool`` turn, and answers; success is the right number. A bad
  expression is a tool *error*, which ends the episode with the reason recorded.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Iterator
from typing import Any

from relax.agents._chat import parse_tool_calls
from relax.agents._env import Env, Step, Task

_NUMBER = re.compile(r"^\s*(-?\d+)")


def guess_tasks(seed: int = 0, *, low: int = 0, high: int = 9) -> Iterator[dict[str, Any]]:
    """Endless GuessNumber tasks: the secret is the ``answer``."""
    rng = random.Random(seed)
    index = 0
    while True:
        yield {
            "id": f"guess-{seed}-{index}",
            "prompt": f"Guess my number ({low}-{high}).",
            "answer": str(rng.randint(low, high)),
        }
        index += 1


class GuessNumber(Env):
    """Guess the secret (``task["answer"]``); hints "higher"/"lower" after a wrong guess.

    ``valid_reward`` is added for each reply that is a number in range not guessed before in
    the episode (0 by default: only success pays).
    """

    def __init__(self, *, low: int = 0, high: int = 9, valid_reward: float = 0.0) -> None:
        self.low, self.high, self.valid_reward = low, high, valid_reward
        self.secret = 0
        self.guessed: set[int] = set()

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        self.secret = int(task["answer"])
        self.guessed = set()
        return [{"role": "user", "content": task["prompt"]}]

    async def step(self, action: str) -> Step:
        match = _NUMBER.match(action)
        if match is None or not self.low <= int(match.group(1)) <= self.high:
            return Step(
                f"Say a number from {self.low} to {self.high}.", 0.0, False, {"success": False}
            )
        guess = int(match.group(1))
        bonus = self.valid_reward if guess not in self.guessed else 0.0
        self.guessed.add(guess)
        if guess == self.secret:
            return Step(None, 1.0 + bonus, True, {"success": True})
        hint = "higher" if guess < self.secret else "lower"
        return Step(hint, bonus, False, {"success": False})


def calc_tasks(seed: int = 0, *, max_operand: int = 99) -> Iterator[dict[str, Any]]:
    """Endless multiplication questions for ``Calculator``."""
    rng = random.Random(seed)
    index = 0
    while True:
        a, b = rng.randint(2, max_operand), rng.randint(2, max_operand)
        yield {"id": f"calc-{seed}-{index}", "prompt": f"What is {a}*{b}?", "answer": str(a * b)}
        index += 1


CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression (+, -, *, /, parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
"""The calculator's OpenAI tool definition (the episode's system turn lists it)."""

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def evaluate(expression: str) -> float:
    """An arithmetic expression's value; raises ``ValueError`` on anything else (never
    ``eval``: the model's text is untrusted)."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    return walk(tree)


class Calculator(Env):
    """Answer ``task["prompt"]`` (a number), optionally calling the ``calc`` tool first.

    A reply with a ``calc`` call gets the result as a ``tool`` turn; a reply without a call is
    the answer (success when it equals ``task["answer"]``). A call that cannot be evaluated
    raises, which ends the episode as a tool error with the reason recorded.
    """

    def __init__(self, *, system: bool = True) -> None:
        self.system = system
        self.answer = ""

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        self.answer = str(task["answer"]).strip()
        messages = [{"role": "user", "content": task["prompt"]}]
        if self.system:
            messages.insert(
                0,
                {
                    "role": "system",
                    "content": 'Tool: calc(expression). Call it as <tool_call>{"name": "calc",'
                    ' "arguments": {"expression": "2*3"}}</tool_call>, then answer.',
                },
            )
        return messages

    async def step(self, action: str) -> Step:
        text, calls = parse_tool_calls(action)
        call = next((c for c in calls if c.name == "calc"), None)
        if call is None:
            match = _NUMBER.match(text)
            right = match is not None and match.group(1) == self.answer
            return Step(None, 1.0 if right else 0.0, True, {"success": right})
        expression = str(json.loads(call.arguments).get("expression", ""))
        value = evaluate(expression)  # raises on a bad expression: a tool error
        shown = int(value) if float(value).is_integer() else round(value, 6)
        return Step(str(shown), 0.0, False)
