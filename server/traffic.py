"""`serve --record-traffic DIR`: finished requests' prompts and outputs, for training a draft head.

Off by default. When on, every choice that finished (`stop` or `length`; aborted and failed ones
are not recorded) becomes one JSON line, in the format `python -m server distill --traffic DIR`
reads (server/draft_head/data.py):

    {"messages": [...], "prompt_ids": [...], "output": "...", "output_ids": [...]}   chat
    {"prompt": "...", "prompt_ids": [...], "output": "...", "output_ids": [...]}     text completion

`prompt_ids` are the tokens the target was fed (chat template and tools applied) and `output_ids`
what it generated, so training teacher-forces exactly what the server saw; the texts are for people.
A text completion's `prompt` is raw text (no chat template), and token-id prompts are stored as ids
only. Lines are written by a background thread (logging's QueueListener, so the event loop only
enqueues) into `DIR/traffic-<start time>-<pid>.jsonl`, rotated at `max_bytes` with `backups` older
files kept. The records hold users' prompts: treat DIR like the request log, or stricter.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import queue
import time
from pathlib import Path
from typing import Any


class TrafficRecorder:
    def __init__(self, directory: str | Path, max_bytes: int = 64 << 20, backups: int = 20) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"traffic-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.jsonl"
        self.path = self.directory / name
        handler = logging.handlers.RotatingFileHandler(
            self.path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._queue: queue.Queue[logging.LogRecord] = queue.Queue(maxsize=10_000)
        self._listener = logging.handlers.QueueListener(self._queue, handler)
        self._listener.start()
        self.dropped = 0  # lines not recorded because the writer fell 10,000 lines behind

    def record(self, prompt: dict[str, Any], prompt_ids: list[int] | tuple[int, ...], output: str,
               output_ids: list[int]) -> None:
        """One finished choice. `prompt`: {"messages": [...]} or {"prompt": text} (or {} for token ids)."""
        line = json.dumps({**prompt, "prompt_ids": list(prompt_ids), "output": output, "output_ids": output_ids})
        try:
            self._queue.put_nowait(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))
        except queue.Full:  # never block a request on the disk
            self.dropped += 1

    def close(self) -> None:
        """Write what is queued and stop the writer thread."""
        self._listener.stop()
        for handler in self._listener.handlers:
            handler.close()
