"""The device-worker process's entry point: `python -m pypto_serving.actors.worker_process FD`.

`DeviceWorkerClient` starts it with one end of a socket pair as FD and sends the encoded
`WorkerConfig` as the first message. A plain subprocess, not a multiprocess "spawn" child:
spawning also starts multiprocess's resource-tracker process (~17 MiB resident for the
server's lifetime), which guards semaphores and shared memory that the worker never uses.
"""

from __future__ import annotations

import os
import sys

from multiprocess.connection import Connection

from pypto_serving.actors.device_worker import worker_main


def main() -> None:
    fd = int(sys.argv[1])
    os.set_inheritable(fd, False)  # a process the worker starts must not keep the pipe open
    conn = Connection(fd)
    try:
        config = conn.recv_bytes()
    except EOFError:  # the server went away before sending the config
        return
    worker_main(conn, config)


if __name__ == "__main__":
    main()
