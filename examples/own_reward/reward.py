"""A reward function of your own: it gets the whole sample (``relax.rewards.Sample``).

Relax calls ``score(response, sample, **options)`` once per generated response: ``response`` is
its text, ``sample`` has the prompt (``sample.prompt``; chat ``sample.messages``), the response
and its token ids (``sample.response_ids``), the reference answer with its JSON type
(``sample.answer``), the dataset row's other fields (``sample["operands"]``, or all of them as
``sample.fields``), and the sample's ``uid`` and ``group``. It may be ``async``; it may return a
number or, as here, a table of named scores: each is logged as ``reward/own/<name>`` and the
sample's reward is their sum, weighted by ``components`` in cluster.toml.

A function that raises, returns NaN or runs past ``timeout`` fails its sample: the sample's
group is dropped with the reason logged (never trained on), and after
``reward.max_failed_groups`` failed groups in a row the run stops with the traceback.

For a reward model, score a batch per call instead: ``batched = true`` and
``def score(responses: list[str], samples: list[Sample]) -> list[float]``.
"""

from __future__ import annotations

from relax.rewards import Sample


async def score(response: str, sample: Sample, *, carry_bonus: float = 0.5) -> dict[str, float]:
    a, b = sample["operands"]  # the row's own field: a list of ints, not a string
    answer = str(sample.answer)  # an int in the row: a + b
    first = response.strip()[:1]
    correct = response.strip().startswith(answer)
    return {
        "digit": float(first.isdigit()),  # the format: answer with a digit
        "correct": float(correct) * (1.0 + carry_bonus * sample["carry"]),
        "ones": float(first == str((a + b) % 10)),  # the last digit of the sum, at least
    }
