"""The ``routed_experts`` column (an MoE policy's routing, for R3): declared, checked where it
enters the bus, carried as raw bytes (never pickled) and through the bus's log."""

from __future__ import annotations

import pytest
import torch

from relax.bus import BusClient
from relax.bus._columns import column_problem
from relax.errors import BadColumn
from relax.roles._common import training_row
from tests.bus.test_service import start_bus

pytestmark = pytest.mark.anyio


def routed(tokens: int) -> torch.Tensor:
    return torch.randint(0, 8, (tokens, 2, 2), dtype=torch.uint8)


def test_one_entry_per_token_of_prompt_and_response() -> None:
    columns = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "routed_experts": routed(5)}
    assert column_problem(columns) is None
    wrong = {**columns, "routed_experts": routed(2)}  # per response token: not this column
    assert column_problem(wrong) == (
        "routed_experts",
        "has 2 entries but prompt_ids and response_ids have 5",
    )
    # Written after the ids: checked against the row's columns already on the bus.
    assert column_problem({"routed_experts": routed(4)}, existing=columns) == (
        "routed_experts",
        "has 4 entries but prompt_ids and response_ids have 5",
    )


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ([[[1, 2]]], "is a list, not a 3-D tensor of ints"),
        (torch.zeros((5, 2), dtype=torch.uint8), "is a tensor of shape [5, 2], not 3-D"),
        (torch.zeros((5, 2, 2)), "is a float32 tensor, not ints"),
    ],
)
def test_anything_but_an_integer_tensor_of_three_dimensions_is_refused(value, problem) -> None:
    assert column_problem({"routed_experts": value}) == ("routed_experts", problem)


async def test_the_column_crosses_a_tcp_bus_and_its_log_as_the_same_integers(tmp_path) -> None:
    record = routed(5)
    row = {
        "uid": "p/0",
        "group": "p",
        "version": 0,
        "columns": {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "routed_experts": record},
    }
    for attempt in range(2):  # the second bus restarts from the first one's log
        sup, url = await start_bus(tmp_path, url="tcp://127.0.0.1:0", tasks=["train"])
        try:
            async with await BusClient.connect(url) as bus:
                if attempt == 0:
                    await bus.put([row])
                    with pytest.raises(BadColumn, match="routed_experts"):
                        bad = {**row, "uid": "p/1"}
                        bad["columns"] = {**row["columns"], "routed_experts": routed(4)}
                        await bus.put([bad])
                    continue
                async with bus.take("train", batch_size=1, optional=["routed_experts"]) as got:
                    taken = training_row(got.rows[0], ())
                assert taken["routed_experts"].dtype == torch.uint8
                assert torch.equal(taken["routed_experts"], record)
        finally:
            await sup.__aexit__(None, None, None)
