"""The dataset role: streams prompts onto the prompt bus, and remembers where it was."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from relax.actors import Actor
from relax.media import MediaError, media_limits
from relax.models import load_processor, load_tokenizer
from relax.roles._common import cluster_config, connect_bus
from relax.roles._prompts import prompt_row, prompt_stream


class DatasetRole(Actor):
    """Puts prompt rows (``prompt_ids``, ``answer``) on the prompt bus, as fast as the bus's
    capacity lets it (backpressure). Its position is saved after every put, so a restarted
    dataset continues instead of starting over; a prompt put twice is deduplicated anyway."""

    def __init__(
        self, *, config: dict[str, Any], prompts_url: str, model_dir: str, run_dir: str
    ) -> None:
        self.cfg = cluster_config(config)
        self.prompts_url, self.model_dir = prompts_url, model_dir
        self.position_file = Path(run_dir, "dataset.position.json")
        self.skipped = 0
        self.media_errors = 0

    def statistics(self) -> dict[str, int]:
        """Prompts served position, and prompts skipped for length or bad media (since this
        start)."""
        return {
            "position": self._position(),
            "skipped_too_long": self.skipped,
            "skipped_bad_media": self.media_errors,
        }

    def _position(self) -> int:
        if self.position_file.exists():
            return int(json.loads(self.position_file.read_text())["next"])
        return 0

    def _save(self, position: int) -> None:
        tmp = self.position_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"next": position}))
        tmp.replace(self.position_file)

    async def run(self) -> None:
        data = self.cfg.data
        tokenizer = load_tokenizer(self.model_dir)
        processor = load_processor(self.model_dir)  # None for a text-only model
        limits = media_limits(data.media)
        start = self._position()
        stream = itertools.islice(prompt_stream(data.model_dump()), start, None)
        async with await connect_bus(self.prompts_url, self.cfg, "dataset") as bus:
            for position, item in enumerate(stream, start):
                try:
                    row = prompt_row(
                        item,
                        tokenizer,
                        data.max_prompt_tokens,
                        processor=processor,
                        limits=limits,
                    )
                except MediaError as exc:  # one bad sample: skip it, say why, go on
                    self.media_errors += 1
                    self.log.warning(
                        "prompt with bad media skipped", id=item["id"], reason=str(exc)
                    )
                    self._save(position + 1)
                    continue
                if row is None:
                    self.skipped += 1
                    self.log.warning(
                        "prompt longer than data.max_prompt_tokens skipped",
                        id=item["id"],
                        max_prompt_tokens=data.max_prompt_tokens,
                    )
                    self._save(position + 1)
                    continue
                await bus.put([row], wait=3600)
                self._save(position + 1)
