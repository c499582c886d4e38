"""Logging for the daemon: one config from ``--log-level``/``--log-format`` (text or one
JSON object per line). Used by the app for its ready line and by ``kvxfer serve``."""

from __future__ import annotations

import json
import logging
import time

from kvxfer.config import Config


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (ISO 8601, UTC), level, logger, message (and exc)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                       + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage(),
               "pid": record.process}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(config: Config) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if config.log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(config.log_level.upper())
