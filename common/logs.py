"""Logging for every process: a line per event, as text or as one JSON object a line."""

from __future__ import annotations

import json
import logging
import sys

# Attributes every LogRecord has; anything else came from `extra=` and belongs in the JSON object.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "process": self.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """Plain lines, with any `extra=` fields appended as key=value."""

    def __init__(self, process: str):
        super().__init__(f"%(asctime)s %(levelname)s {process} %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = [f"{k}={v}" for k, v in vars(record).items() if k not in _STANDARD]
        return f"{line} {' '.join(extra)}" if extra else line


def setup(level: str, fmt: str, process: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process) if fmt == "json" else TextFormatter(process))
    logging.basicConfig(level=level, handlers=[handler], force=True)
