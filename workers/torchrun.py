"""`torchrun` for a container's PID 1: `python -m workers.torchrun <torchrun's arguments>`.

It is torch's own launcher (`torch.distributed.run`), with one difference: stopped with SIGTERM
or SIGINT (`docker stop`, `docker compose stop`), torchrun passes the signal to its ranks (they
shut down and deregister) and then raises `SignalException`, exits 1 and prints a traceback,
which reads as a crash. Here the stop is what it is: one log line, exit status 0. Every other
outcome (a rank failing, a rendezvous that times out) is torchrun's, unchanged.
"""

from __future__ import annotations

import logging
import signal
import sys

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# torchrun's own two warnings on a stop, said once instead by the line below.
_STOP_MESSAGES = (
    "Received %s death signal, shutting down workers",
    "Sending process %s closing signal %s",
)
log = logging.getLogger("workers.torchrun")


class _StopNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _STOP_MESSAGES


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)  # type: ignore[no-untyped-call]
    for name in (
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.api",
    ):
        logging.getLogger(name).addFilter(_StopNoise())
    try:
        record(run)(args)  # as torchrun's own main: a failed rank's error summary
    except SignalException as stop:
        if stop.sigval not in STOP_SIGNALS:
            raise
        name = signal.Signals(stop.sigval).name
        print(f"torchrun stopped by {name}: its ranks were stopped and have exited", flush=True)
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
