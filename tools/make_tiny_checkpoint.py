#!/usr/bin/env python
# Writes a tiny random-weight Qwen3-Omni checkpoint (released format) for CPU tests.
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from omnistage.models.tiny_checkpoint import make_tiny_checkpoint

    start = time.perf_counter()
    out = make_tiny_checkpoint(args.out, seed=args.seed)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
