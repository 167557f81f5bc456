"""``python -m fxad.tools.fuzz --n N --seed S [--out DIR] [--mode reverse|forward|both]``."""
from __future__ import annotations

import argparse
import sys

from ...argparsing import ArgumentParser
from .runner import run_batch


DESCRIPTION = ("Random programs through fxad.vjp/fxad.jvp, compared with eager PyTorch "
               "(float64); writes a minimal reproducer for each wrong result or crash.")


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m fxad.tools.fuzz", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The fuzzer's options (``python -m fxad.tools.fuzz`` and ``fxad fuzz``)."""
    p.add_argument("--n", type=int, default=500, help="number of programs (default 500)")
    p.add_argument("--seed", type=int, default=0, help="batch seed (default 0)")
    p.add_argument("--start", type=int, default=0, help="index of the first program")
    p.add_argument("--out", "-o", default="fuzz_failures",
                   help="directory for reproducers (default ./fuzz_failures)")
    p.add_argument("--mode", choices=("reverse", "forward", "dynamic", "both", "all"),
                   default="all",
                   help="reverse: fxad.vjp; forward: fxad.jvp; dynamic: fxad.vjp built on "
                        "symbolic sizes and checked at 3 other sizes; both: reverse and "
                        "forward; all (default): the three")
    p.add_argument("--no-shrink", action="store_true", help="write failing programs unshrunk")
    p.add_argument("--focus", default="",
                   help="comma-separated op families drawn 6x as often (e.g. inplace,alias)")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    p.add_argument("--families", action="store_true",
                   help="print how many programs use each op family")


def run(args: argparse.Namespace) -> int:
    """Run a batch with parsed options; exit status 1 on a wrong result or crash."""
    modes = ("reverse", "forward") if args.mode == "both" else \
        ("reverse", "forward", "dynamic") if args.mode == "all" else (args.mode,)
    log = None if args.quiet else (lambda s: print(s, flush=True))
    summary = run_batch(args.n, args.seed, modes=modes, out_dir=args.out,
                        do_shrink=not args.no_shrink, start=args.start, log=log,
                        focus=tuple(f for f in args.focus.split(",") if f))
    print(summary.report())
    if args.families:
        print("  families: " + ", ".join(f"{k} {v}" for k, v in sorted(summary.families.items())))
    paths = [p for _, _, p in summary.failures if p]
    if paths:
        print(f"{len(paths)} reproducer(s) written to {args.out}/")
    bad = summary.counts["wrong"] + summary.counts["crash"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
