"""Built-in environments and their task generators (``[data] generator``).

- ``GuessNumber``: a text game. The model guesses a secret number; after each wrong guess the
  environment answers "higher" or "lower". Success (1.0) is guessing it within the turns. A
  random policy almost never answers with a number; an RL-trained one learns to, and to use
  the answers.
- ``Calculator``: a tool-use episode. The model may call ``calc`` (OpenAI/Hermes tool-call
  format, ``<tool_call>{"name": "calc", "arguments": {"expression": "12*7"}}</tool_call>``),
  gets the result as a ``tool`` turn, and answers; success is the right number. A bad
  expression is a tool *error*, which ends the episode with the reason recorded.
- ``ShapeQuest``: media in a later turn. The user asks the colour of a shape without showing
  it; whatever the model says first, the environment answers with the picture (an image
  observation), and the model's next reply is judged: success when its first character (after
  spaces) is the colour's letter, ``r``, ``g`` or ``b``. Needs a model with an image processor.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
import zlib
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


SHAPE_QUEST_PROMPT = "What colour is my shape? Answer r, g or b."
SHAPE_QUEST_LETTERS = {"r": "red", "g": "green", "b": "blue"}
"""Answer letter → ``relax.media.PALETTE`` colour of the shapes."""


def shape_quest_tasks(seed: int = 0) -> Iterator[dict[str, Any]]:
    """Endless ``ShapeQuest`` tasks: the colour's letter is the ``answer`` (the environment
    draws the picture from the task's id and answer, so a dataset row carries no media)."""
    rng = random.Random(seed)
    index = 0
    while True:
        yield {
            "id": f"shape_quest-{seed}-{index}",
            "prompt": SHAPE_QUEST_PROMPT,
            "answer": rng.choice(sorted(SHAPE_QUEST_LETTERS)),
        }
        index += 1


class ShapeQuest(Env):
    """Name the colour of shapes shown only after the first reply (see the module docstring).

    The picture (``size`` square, 1..``max_count`` shapes of the answer's colour on white,
    drawn by ``relax.media.draw_shapes``) depends only on the task, so a replayed episode shows
    the same one. ``role`` is the chat role of the image turn.
    """

    def __init__(self, *, size: int = 56, max_count: int = 3, role: str = "user") -> None:
        self.size, self.max_count, self.role = size, max_count, role
        self.answer = ""
        self.image: Any = None
        self.shown = False

    async def reset(self, task: Task) -> list[dict[str, Any]]:
        from relax.media import draw_shapes  # Pillow and torch: only when this env is used

        self.answer = str(task["answer"]).strip().lower()
        if self.answer not in SHAPE_QUEST_LETTERS:
            raise ValueError(f"a ShapeQuest answer is one of r, g, b, not {task['answer']!r}")
        seed = zlib.crc32(f"{task.get('id', '')}/{self.answer}".encode())
        image, _ = draw_shapes(
            seed,
            size=self.size,
            max_count=self.max_count,
            colors=(SHAPE_QUEST_LETTERS[self.answer],),
        )
        self.image = image.numpy()
        self.shown = False
        return [{"role": "user", "content": task.get("prompt") or SHAPE_QUEST_PROMPT}]

    async def step(self, action: str) -> Step:
        if not self.shown:
            self.shown = True
            picture = [
                {"type": "image", "image": self.image},
                {"type": "text", "text": "Here it is. r, g or b?"},
            ]
            # success is False until judged: an episode cut short still reports it.
            return Step([{"role": self.role, "content": picture}], 0.0, False, {"success": False})
        right = action.strip()[:1].lower() == self.answer
        return Step(None, 1.0 if right else 0.0, True, {"success": right})
