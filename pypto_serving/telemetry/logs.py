"""structlog set-up: human-readable console lines or one JSON object per line.

structlog loggers and the standard library's (aiohttp, asyncio, `warnings`) go through the
same renderer, so in JSON mode every line a process writes is one JSON object with `event`,
`level` and `timestamp`. A device worker also catches what C extensions write straight to
its file descriptors (`capture_stray_output`), which no Python logging setup can see.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType

import structlog

log = structlog.get_logger()


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    shared = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
              structlog.processors.TimeStamper(fmt="iso", utc=True)]
    numeric = getattr(logging, level.upper())
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # one write() per line: processes sharing a pipe never interleave within a line
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _route_stdlib(renderer, shared, numeric)
    if fmt == "json":  # the default hooks print multi-line tracebacks
        sys.excepthook = _log_uncaught
        sys.unraisablehook = _log_unraisable
        threading.excepthook = _log_thread_uncaught


def _route_stdlib(renderer: object, shared: list, level: int) -> None:
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    log.critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_unraisable(args: sys.UnraisableHookArgs) -> None:
    log.error(args.err_msg or "exception ignored", object=repr(args.object),
              exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def _log_thread_uncaught(args: threading.ExceptHookArgs) -> None:
    log.critical("uncaught exception in a thread", thread=getattr(args.thread, "name", None),
                 exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


# -- raw output of C extensions (JSON mode, device workers) ---------------------------


def capture_stray_output() -> Callable[[], None]:
    """Sends fds 1 and 2 through pipes whose non-JSON lines are wrapped into JSON log lines.

    Returns the function that restores the descriptors and waits until every captured line
    is written; call it before the process exits.
    """
    pumps = [_redirect(1, "stdout", "info"), _redirect(2, "stderr", "warning")]

    def restore() -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, saved, thread in pumps:
            os.dup2(saved, fd)  # closes the pipe's last write end: the pump sees EOF
            os.close(saved)
            thread.join(2.0)

    return restore


def _redirect(fd: int, stream: str, level: str) -> tuple[int, int, threading.Thread]:
    read_fd, write_fd = os.pipe()
    saved = os.dup(fd)
    out_fd = os.dup(fd)
    os.dup2(write_fd, fd)
    os.close(write_fd)
    thread = threading.Thread(target=_pump, args=(read_fd, out_fd, stream, level),
                              name=f"{stream}-as-json", daemon=True)
    thread.start()
    return fd, saved, thread


def _pump(read_fd: int, out_fd: int, stream: str, level: str) -> None:
    with os.fdopen(read_fd, "rb") as src, os.fdopen(out_fd, "wb", buffering=0) as out:
        for raw in src:
            out.write(as_json_line(raw.decode("utf-8", "replace"), stream, level).encode())


def as_json_line(text: str, stream: str, level: str) -> str:
    """A JSON line stays as it is; anything else becomes one; blank lines vanish."""
    text = text.rstrip("\r\n")
    if not text.strip():
        return ""
    if text.startswith("{") and text.endswith("}"):
        return text + "\n"
    now = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
    return json.dumps({"event": text, "level": level, "timestamp": now, "stream": stream}) + "\n"
