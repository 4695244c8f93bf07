"""The picture of a plan: regular (DDP) and pipeline micro-batches side by side.

Usage:
    python plot_plan.py [the flags of `python varbatch.py plan`] OUTPUT.png
    python plot_plan.py --world-size 2 plan.png     # the README's picture (synthetic lengths)
    python plot_plan.py --config ds_config.json --seqlens lengths.npy --world-size 8 plan.png

The epoch is planned twice as `python varbatch.py plan` plans it (same parser,
config reader and packer), without and with --pipeline. The first batches of
each (--batches, default 2) are drawn: each sample a row, its tokens filled,
its padding empty up to the S of its micro-batch's tensor; each micro-batch is
labelled ``BxSxE, N tokens`` (B samples padded to S, E the embedding width, N
real tokens). Below, histograms of B and of the LR factor over the whole
epoch. The drawing costs a box and a step outline per micro-batch drawn (two
points per sample), whatever the token counts. Needs matplotlib (pip install matplotlib); a bad flag, file or
value prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import varbatch

MAX_MICROBATCHES = 6  # drawn per batch; the others are counted
MAX_BATCHES = 40  # drawn per plan: more rows than a picture has pixels show nothing more, and cost minutes
# Shares of the panel height for a text line and the gaps, so that text stays
# legible however many sample rows there are (rows share the rest; with many
# batches drawn, text and gaps shrink to 60% of the panel in all).
LINE, MICROBATCH_GAP, BATCH_GAP = 0.03, 0.012, 0.02
TOKEN, PADDING = "#3b75af", dict(fill=False, edgecolor="#a0a0a0", linewidth=0.6)
PANEL_PIXELS = 600  # about the height of a plan's panel: rows at least 3 pixels tall get a gap between them


def _shown(plan, num_batches: int) -> list[range]:
    """The micro-batches drawn, per batch: the first `MAX_MICROBATCHES` of each of the first batches."""
    k = plan.effective_batch_size
    return [range(b * k, b * k + min(k, MAX_MICROBATCHES)) for b in range(min(num_batches, plan.num_batches))]


def _draw_plan(ax, plan, seqlens, factors, num_batches: int, height: float, text: float, longest: int) -> None:
    """The first ``num_batches`` batches of ``plan``, top to bottom, in ``height`` rows of one sample each.

    A micro-batch is its B x S tensor as a box (empty: padding) and the
    samples' tokens as one filled step outline, a row per sample: a single
    path, so that rows thinner than a pixel still blend into the real share.
    ``text`` scales the text and the gaps (1: their full shares of the height).
    """
    from matplotlib.patches import Rectangle

    k, gaps, ends, y, unit = plan.effective_batch_size, [], [], 0.0, text * height
    for b, microbatches in enumerate(_shown(plan, num_batches)):
        ax.text(
            0,
            y + 0.8 * LINE * unit,
            f"batch {b}: B={plan.batch_sizes[b]} sequences, {plan.batch_tokens[b]} tokens, LR factor {factors[b]:.3g}",
            fontsize=8.5 * text,
            fontweight="bold",
            va="bottom",
        )
        y += LINE * unit
        for j in microbatches:
            ids, s = plan.microbatch(j), int(plan.padded_seqlens[j])
            ax.add_patch(Rectangle((0, y), s, len(ids), zorder=3, **PADDING))  # above the rows' gaps
            ax.stairs(seqlens[ids], y + np.arange(len(ids) + 1), orientation="horizontal", fill=True, color=TOKEN)
            ax.text(
                s + 0.02 * longest,
                y + len(ids) / 2,
                f"{len(ids)}x{s}xE, {int(seqlens[ids].sum())} tokens",
                fontsize=7.5 * text,
                va="center",
            )
            gaps.append(y + np.arange(1, len(ids)))
            ends.append(np.full(len(ids) - 1, s))
            y += len(ids) + MICROBATCH_GAP * unit
        if k > MAX_MICROBATCHES:
            ax.text(
                0,
                y + 0.5 * LINE * unit,
                f"... {k - MAX_MICROBATCHES} more micro-batches in this batch",
                fontsize=7.5 * text,
                style="italic",
                va="center",
            )
            y += LINE * unit
        y += BATCH_GAP * unit
    if PANEL_PIXELS / height >= 3:  # a white line between rows, a fifth of a row (72 points per 90 pixels)
        ax.hlines(np.concatenate(gaps), 0, np.concatenate(ends), color="white", linewidth=0.16 * PANEL_PIXELS / height)
    ax.set_xlim(0, 1.55 * longest)  # room for the labels
    ax.set_ylim(height, 0)
    ax.set_yticks([])
    ax.spines[["left", "right", "top"]].set_visible(False)
    ax.set_xlabel("tokens (padded S)")


def _extent(plan, num_batches: int) -> tuple[int, float]:
    """The sample rows drawn, and the share of the panel's height that text lines and gaps take."""
    shown = _shown(plan, num_batches)
    rows = sum(len(plan.microbatch(j)) for microbatches in shown for j in microbatches)
    share = sum(LINE * (1 + (plan.effective_batch_size > len(m))) + MICROBATCH_GAP * len(m) + BATCH_GAP for m in shown)
    return rows, share


def draw(path: str, panels: list[tuple], seqlens: np.ndarray, title: str, num_batches: int) -> None:
    """Writes the picture of ``panels`` (``(heading, plan, lr)`` each) to ``path``."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(14, 10.5), dpi=90, layout="constrained")
    grid = fig.add_gridspec(2, len(panels), height_ratios=[3.2, 1])
    fig.suptitle(title, fontsize=11)
    extents = [_extent(plan, num_batches) for _, plan, _ in panels]
    text = min(1.0, 0.6 / max(share for _, share in extents))
    height = max(rows / (1 - share * text) for rows, share in extents)  # one scale: rows compare across panels
    longest = max(int(plan.padded_seqlens[j]) for _, plan, _ in panels for m in _shown(plan, num_batches) for j in m)
    for c, (heading, plan, lr) in enumerate(panels):
        ax = fig.add_subplot(grid[0, c])
        _draw_plan(ax, plan, seqlens, lr["factors"], num_batches, height, text, longest)
        t = plan.totals()
        big = t["largest_step_input"]
        ax.set_title(
            f"{heading}\n{t['batches']} batches, {t['efficiency']:.1%} of padded tokens are real, largest "
            f"step input {big['sequences']}x{big['padded_seqlen']} = {big['tokens']} tokens",
            fontsize=9.5,
        )
    fig.axes[0].legend(
        handles=[Patch(facecolor=TOKEN, label="token"), Patch(**PADDING, label="padding")],
        loc="lower right",
        fontsize=8,
        frameon=False,
    )
    # B and the LR factor over the whole epoch; solid and dashed outlines, so that equal ones stay visible.
    sizes = np.concatenate([plan.batch_sizes for _, plan, _ in panels])
    low, high = int(sizes.min()), int(sizes.max())
    factors = np.concatenate([lr["factors"] for _, _, lr in panels])
    bins = {
        "B": np.arange(low - 0.5, high + 1.5) if high - low <= 60 else 40,  # one bar per B when few
        "LR": np.linspace(factors.min() - 0.05, factors.max() + 0.05, 41),
    }
    ax_b, ax_lr = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, len(panels) - 1])
    for (heading, plan, lr), color, style in zip(panels, (TOKEN, "#d9822b"), ("-", "--")):
        name = heading.split(":")[0]
        for ax, values, key in ((ax_b, plan.batch_sizes, "B"), (ax_lr, lr["factors"], "LR")):
            ax.hist(values, bins=bins[key], histtype="step", linewidth=1.5, color=color, linestyle=style, label=name)
    lr = panels[0][2]
    unit, reference = lr["lr_scaling_unit"], lr["lr_scaling_reference"]
    ref = (
        f"train_batch_size = {lr['reference_value']:g}"
        if reference is None
        else "each plan's mean B"
        if reference == "mean"
        else f"{reference:g}"
    ) + f" ({unit})"
    ax_lr.axvline(1.0, color="black", linewidth=0.8, linestyle=":")
    for ax, xlabel, heading in (
        (ax_b, "B: sequences per batch", "batch size B over the epoch"),
        (
            ax_lr,
            f"LR factor s(B / B_ref), {lr['lr_scaling_method']} rule, B_ref = {ref}",
            "LR factor over the epoch (dotted: the configured LR)",
        ),
    ):
        ax.set(xlabel=xlabel, ylabel="batches")
        ax.set_title(heading, fontsize=9.5)
        ax.legend(fontsize=8, frameon=False, loc="upper right")
    fig.savefig(path)


def main(argv=None) -> int:
    """``python plot_plan.py [plan flags] OUTPUT.png``; returns the exit code (0, or 2 on bad input)."""
    parser, p = varbatch._cli_parser("python plot_plan.py")
    p.prog, p.description = "python plot_plan.py", __doc__.splitlines()[0]
    p.epilog = (
        f"--batches N: batches drawn per plan (default 2, 0 for all, at most {MAX_BATCHES}); --json is "
        "ignored.\nexamples:\n"
        + "\n".join(line[2:] for line in __doc__.splitlines() if line.startswith("    python plot_plan.py --"))
    )
    p.add_argument("output", metavar="OUTPUT.png", help="the picture to write (the format follows the suffix)")
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    num_batches = min(2 if args.batches is None else args.batches or sys.maxsize, MAX_BATCHES)
    if args.batches is not None and not 0 < args.batches <= MAX_BATCHES:
        print(
            f"plot_plan: drawing the first {MAX_BATCHES} batches of each plan (`python varbatch.py plan --batches 0`"
            f" lists them all)",
            file=sys.stderr,
        )
    try:
        try:
            import matplotlib  # noqa: F401  (the only module that needs it)
        except ImportError:
            raise ValueError("plot_plan.py needs matplotlib, which is not installed: pip install matplotlib") from None
        lengths, panels = varbatch._read_seqlens(args.seqlens), []  # read once: stdin too
        for pipeline, heading in (
            (False, "regular (DDP): each micro-batch padded to its step input's longest"),
            (True, "pipeline: same-size micro-batches, padded to their batch's longest"),
        ):
            plan, lr, seqlens, source = varbatch._cli_plan(
                argparse.Namespace(**{**vars(args), "pipeline": pipeline}), lengths
            )
            panels.append((heading, plan, lr))
        s = plan.settings
        title = (
            f"{len(seqlens)} samples ({source}), max_tokens={s.max_tokens} ({s.budget} budget), order {s.order},"
            f" {s.effective_batch_size} micro-batches per batch ({s.micro_batch_size} per step input x "
            f"{s.gradient_accumulation_steps} accumulation x {s.num_replicas} ranks), epoch {plan.epoch}"
        )
        draw(args.output, panels, seqlens, title, num_batches)
    except (OSError, ValueError, TypeError) as error:
        text = f"{error.filename}: {error.strerror}" if isinstance(error, OSError) and error.filename else str(error)
        print(f"plot_plan: error: {' '.join(text.split())}", file=sys.stderr)
        return 2
    print(f"plot_plan: wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
