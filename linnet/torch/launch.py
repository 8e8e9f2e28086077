"""`linnet-torchrun`: torchrun, whose run ends as its workers' user errors do.

    linnet-torchrun --nproc-per-node 2 examples/sft/sft_torch.py --steps 100

It takes torchrun's options and runs torchrun's agent. One thing differs: where a worker ends with a
user error (exit status 2: it has printed its one line, from the first rank, as linnet.errors has every
script do), the run ends with status 2 and nothing more. torchrun itself reports any worker failure with
its own traceback and summary, and exits 1; so it does here for any other failure, a bug's traceback
included. The agent's log lines on a user error are left out."""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from linnet.errors import EXIT_STATUS

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as failure:
        _, first = failure.get_first_failure()
        if first.exitcode != EXIT_STATUS:
            raise
        return EXIT_STATUS
    return 0


class _QuietOnUserError(logging.Filter):
    """The agent logs a worker that exits with a user error's status, and the signals that stop the others:
    lines that say nothing the user's one line did not."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "closing signal" not in message and f"failed (exitcode: {EXIT_STATUS})" not in message


logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietOnUserError())

if __name__ == "__main__":
    sys.exit(main())
