"""``python -m fxad.tools.fuzz --n N --seed S [--out DIR] [--mode reverse|forward|both]``."""
from __future__ import annotations

import argparse
import sys

from .runner import run_batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fxad.tools.fuzz",
        description="Random programs through fxad.vjp/fxad.jvp, compared with eager PyTorch "
                    "(float64); writes a minimal reproducer for each wrong result or crash.")
    p.add_argument("--n", type=int, default=500, help="number of programs (default 500)")
    p.add_argument("--seed", type=int, default=0, help="batch seed (default 0)")
    p.add_argument("--start", type=int, default=0, help="index of the first program")
    p.add_argument("--out", default="fuzz_failures",
                   help="directory for reproducers (default ./fuzz_failures)")
    p.add_argument("--mode", choices=("reverse", "forward", "both"), default="both")
    p.add_argument("--no-shrink", action="store_true", help="write failing programs unshrunk")
    p.add_argument("--focus", default="",
                   help="comma-separated op families drawn 6x as often (e.g. inplace,alias)")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    p.add_argument("--families", action="store_true",
                   help="print how many programs use each op family")
    args = p.parse_args(argv)
    modes = ("reverse", "forward") if args.mode == "both" else (args.mode,)
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
