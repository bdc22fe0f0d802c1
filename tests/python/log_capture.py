"""What zcore logs, collected inside a rank process."""

from __future__ import annotations

import logging


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def capture_zcore_log() -> Messages:
    """From now on, zcore's INFO messages and above land in the returned handler."""
    messages = Messages()
    logger = logging.getLogger("zcore")
    logger.addHandler(messages)
    logger.setLevel(logging.INFO)
    return messages
