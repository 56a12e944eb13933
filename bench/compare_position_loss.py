"""Overlay the loss-by-position curves of several models (`hybridtron eval loss --out DIR` each) in one plot.

    python bench/compare_position_loss.py --out docs/experiments/long_context_position.png --training-length 256 \\
        base=runs/eval/quickstart/position phase=runs/eval/long/position control=runs/eval/long-control/position
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("curves", nargs="+", metavar="LABEL=DIR", help="a label and an `eval loss --out` directory")
    parser.add_argument("--training-length", type=int, help="mark the models' training length (default: none)")
    parser.add_argument("--title", default="held-out loss by position", help="the plot's title (default: %(default)s)")
    parser.add_argument("--out", required=True, help="the PNG to write (required)")
    args = parser.parse_args()

    import matplotlib  # the plots extra
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for item in args.curves:
        label, _, directory = item.partition("=")
        report = json.loads((Path(directory) / "loss_by_position.json").read_text())
        for length in report["lengths"]:
            buckets = length["buckets"]
            x = [math.sqrt((b["start"] + 1) * b["end"]) for b in buckets]
            axes.plot(x, [b["mean_ce"] for b in buckets], marker="o", markersize=3,
                      label=f"{label} (L = {length['length']:,}, {length['windows']} windows)")
    if args.training_length:
        axes.axvline(args.training_length, color="grey", linestyle="--", linewidth=1,
                     label=f"training length {args.training_length:,}")
    axes.set_xscale("log", base=2)
    axes.set(xlabel="tokens seen (position + 1, log scale)", ylabel="mean next-token CE (nats)", title=args.title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=100)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
