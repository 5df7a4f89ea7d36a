"""How an evidence script ends: its exit code, and a bad input as one ``PROG: error:`` line, as
the ``qsdp`` command ends."""

from __future__ import annotations

import sys
from typing import Callable, Sequence

from qsdp.train.args import USER_ERRORS

EXIT_USAGE = 2


def run_script(main: Callable[[list[str] | None], int], prog: str, argv: Sequence[str] | None = None) -> int:
    """``main(argv)``'s exit code; its argparse's exit (help, usage error) and qsdp's input errors
    (an unknown preset, a bad corpus, ...) become exit codes, the latter after one line."""
    try:
        return int(main(None if argv is None else list(argv)) or 0)
    except SystemExit as e:  # its own argparse: --help, or a usage error already printed
        if isinstance(e.code, str):
            sys.stderr.write(f"{prog}: error: {e.code}\n")
            return EXIT_USAGE
        return int(e.code or 0)
    except USER_ERRORS as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        return EXIT_USAGE
