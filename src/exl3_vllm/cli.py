"""The `exl3-vllm` command: synth, inspect, explain, kernels, doctor."""

from __future__ import annotations

import argparse
import importlib
import sys

from .format.errors import Exl3FormatError

# Subcommand modules, imported lazily so `inspect` never pays for torch.cuda or NVRTC.
_SUBCOMMANDS = ("exl3_vllm.synth.cli", "exl3_vllm.inspect_cmd", "exl3_vllm.explain_cmd", "exl3_vllm.kernels.cli",
                "exl3_vllm.doctor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exl3-vllm", description="EXL3 checkpoints for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("exl3_vllm"):
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except Exl3FormatError as e:
        print(f"exl3-vllm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
