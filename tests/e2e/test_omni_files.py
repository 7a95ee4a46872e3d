"""Media datasets from files: a JSON Lines file referencing images by relative path and a
Parquet file holding raw image bytes both train; a missing image skips only its record."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from relax import cluster
from relax.config import parse_config
from relax.media import mm_from_wire
from tests.e2e.audit import check_exactly_once, read_metrics, replay_samples_bus
from tests.e2e.test_omni import OMNI
from tests.tiny import tiny_toml

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def png(colour: tuple[int, int, int]) -> bytes:
    image = Image.fromarray(np.full((56, 56, 3), colour, dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def messages(source) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": source}, {"type": "text", "text": "Colour?"}],
        }
    ]


COLOURS = {"r": (220, 30, 30), "g": (30, 200, 30), "b": (30, 30, 220)}


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
async def test_media_dataset_files_train(tmp_path, kind) -> None:
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    records = []
    for i, (answer, colour) in enumerate(list(COLOURS.items()) * 2):
        if kind == "jsonl":
            name = f"images/{i}.png"
            (data / name).write_bytes(png(colour))
            source = name if i != 4 else "images/missing.png"  # one record's file is gone
        else:
            source = {"bytes": png(colour)} if i != 4 else {"bytes": b"not a png"}
        records.append({"id": f"img{i}", "prompt": messages(source), "answer": answer})
    if kind == "jsonl":
        path = data / "train.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path = data / "train.parquet"
        pq.write_table(pa.Table.from_pylist(records), path)
    cfg = parse_config(
        tiny_toml(
            f"files-{kind}",
            steps=2,
            model=OMNI,
            data=f'path = "{path}"\nmax_prompt_tokens = 512',
        )
    )
    layout = await cluster.run(cfg, tmp_path / "run")  # started from elsewhere: paths resolve
    assert len([s for s in read_metrics(layout.run_dir) if s["applied"]]) == 2
    ledger = replay_samples_bus(layout.run_dir)
    check_exactly_once(ledger)
    groups = {ledger.rows[u]["group"].split("@")[0] for u in ledger.rows}
    assert "img4" not in groups and groups  # the bad record was skipped, the others served
    for uid in ledger.trained:
        assert "pixel_values" in mm_from_wire(ledger.rows[uid]["columns"]["mm_inputs"])
    lines = (layout.run_dir / "logs" / "dataset.jsonl").read_text().splitlines()
    skipped = [json.loads(x) for x in lines if "bad media" in x]
    assert {e["id"].split("@")[0] for e in skipped} == {"img4"}
