"""The `pypto-serving` command: `pypto-serving daemon ...` manages background servers
(app/daemon.py); anything else runs a server in the foreground (app/cli.py)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["daemon"]:
        from pypto_serving.app.daemon import main as daemon_main

        return daemon_main(argv[1:])
    from pypto_serving.app.cli import main as serve_main

    return serve_main(argv)
