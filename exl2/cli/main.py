"""`exl2` command: one subcommand per module under exl2/cli; user errors become one line on stderr, exit 2."""
from __future__ import annotations

import argparse
import os
import sys

from exl2.errors import Exl2Error

COMMANDS = ("generate", "chat", "embed", "info", "import_gguf", "bench", "convert", "eval", "serve", "mcp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exl2", description="Run, convert and serve EXL2 / GPTQ / fp16 language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    import importlib

    for name in COMMANDS:
        module = importlib.import_module(f"exl2.cli.{name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except Exl2Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. `| head`): not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
