"""See what a config does to a dataset before training: its batches as a table, as JSON, or as a picture.

Usage:
    python plan.py --config ds_config.json --seqlens lengths.npy              # the table
    python plan.py --config ds_config.json --seqlens lengths.npy --json       # the same plan as JSON
    python plan.py --config ds_config.json --seqlens lengths.npy --plot plan.png
    python plan.py --world-size 2 --plot plan.png     # the README's picture (synthetic lengths)
    cut -f2 lengths.tsv | python plan.py --seqlens - --max-tokens 8192 --json
    python plan.py --help                             # every flag

One epoch is planned as training plans it: varbatch's config reader, batch
arithmetic and packer, called here, never copied. The table lists the first
batches (their B, micro-batches, padded S, tokens, padding and LR factor), then
the totals and the drops. The picture plans the epoch twice, without and with
--pipeline, and draws the first batches of each: each sample a row, its tokens
filled, its padding empty up to the S of its micro-batch's tensor; each
micro-batch labelled ``BxSxE, N tokens`` (B samples padded to S, E the
embedding width, N real tokens); below, histograms of B and of the LR factor
over the whole epoch. The drawing costs a box and a step outline per
micro-batch drawn, whatever the token counts. Only --plot needs matplotlib
(pip install matplotlib), imported where it draws. A bad flag, file or value
prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

import varbatch

# The command's messages begin with this name: they did when the command was `python varbatch.py plan`.
NAME = "varbatch"
BAD_INPUT = (OSError, ValueError, TypeError)  # what a missing file, a bad value or a bad type raises
TABLE_BATCHES = 10  # batches the table lists unless --batches says otherwise
PLOT_BATCHES = 2  # batches drawn per plan unless --batches says otherwise
MAX_MICROBATCHES = 6  # drawn per batch; the others are counted
MAX_BATCHES = 40  # drawn per plan: more rows than a picture has pixels show nothing more, and cost minutes
# Shares of the panel height for a text line and the gaps, so that text stays
# legible however many sample rows there are (rows share the rest; with many
# batches drawn, text and gaps shrink to 60% of the panel in all).
LINE, MICROBATCH_GAP, BATCH_GAP = 0.03, 0.012, 0.02
TOKEN, PADDING = "#3b75af", dict(fill=False, edgecolor="#a0a0a0", linewidth=0.6)
PANEL_PIXELS = 600  # about the height of a plan's panel: rows at least 3 pixels tall get a gap between them

EPILOG = """\
Settings come from --config (its dynamic_batching section, read as training reads it); a flag
overrides its value. train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps
x world size, as DeepSpeed resolves it (a missing one derived from the others). Without --seqlens:
2000 synthetic lengths (lognormal, median about 240 tokens, clipped to [8, 4096]), always the same.
examples:
  python plan.py
  python plan.py --config ds_config.json --seqlens lengths.npy --world-size 8 --pipeline
  cut -f2 lengths.tsv | python plan.py --seqlens - --max-tokens 8192 --json
  python plan.py --world-size 2 --plot plan.png
  python plan.py --config ds_config.json --seqlens lengths.npy --world-size 8 --plot plan.png
"""

# =============================================================================
# The flags
# =============================================================================


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line like every other error of the command."""

    def error(self, message):
        self.exit(2, f"{NAME}: error: {message} (see {self.prog} --help)\n")


def _whole(text: str, minimum: int = 1) -> int:
    """A flag's whole number ``>= minimum``."""
    if not text.isdigit() or int(text) < minimum:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
    return int(text)


def _whole_or_zero(text: str) -> int:
    """A flag's whole number ``>= 0``."""
    return _whole(text, minimum=0)


def _reference(text: str) -> float | str:
    """``--lr-scaling-reference``: a number > 0, or ``mean``."""
    if text == "mean":
        return text
    try:
        return varbatch._check_real("--lr-scaling-reference", float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0 or mean, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    """The command's flags."""
    parser = _Parser(
        prog="python plan.py",
        allow_abbrev=False,
        description="Plan one epoch as training will.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"varbatch {varbatch.__version__}")
    for flag, kind, text in (
        ("--config", str, "DeepSpeed config (ds_config.json) with a dynamic_batching section"),
        ("--seqlens", str, "lengths: a .npy array, a text file of one length per line, or - for stdin"),
        ("--world-size", _whole, "data-parallel ranks (default: from the config, else 1)"),
        ("--effective-batch-size", _whole, "micro-batches per batch, replacing train_batch_size (and accumulation)"),
        ("--epoch", _whole_or_zero, "epoch to plan (default 0)"),
        ("--max-tokens", _whole, "token budget of one micro-batch (default: the config's, else 4096)"),
        ("--budget", str, "sum or padded (default: the config's, else sum)"),
        ("--order", str, "dataloader, seqlen, random or bucket (default: the config's, else dataloader)"),
        (
            "--packing",
            str,
            "greedy or best_fit (default: the config's, else best fit for flat rows in the random order)",
        ),
        ("--seed", _whole_or_zero, "seed of the random and bucket orders (default: the config's)"),
        ("--lr-scaling-method", str, "linear, sqrt or none (default: the config's, else linear)"),
        ("--lr-scaling-unit", str, "sequences or tokens (default: the config's, else sequences)"),
        (
            "--lr-scaling-reference",
            _reference,
            "B_ref: a number or mean (default: the config's, else train_batch_size)",
        ),
        ("--batches", _whole_or_zero, f"batches listed, 0 for all (default {TABLE_BATCHES}; see --plot)"),
    ):
        parser.add_argument(flag, type=kind, help=text)
    parser.add_argument(
        "--pipeline", action="store_true", help="same-size, same-length micro-batches (a PipelineEngine)"
    )
    parser.add_argument(
        "--padding-free",
        action="store_true",
        help="each step input one flat row (padding_free; default: the config's); with --pipeline, rows of one "
        "length per batch",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print settings, totals, batches and drops as JSON")
    output.add_argument(
        "--plot",
        metavar="OUTPUT.png",
        help=f"draw the plan, regular and pipeline side by side, to this picture (the format follows the suffix); "
        f"--batches counts the batches drawn per plan (default {PLOT_BATCHES}, at most {MAX_BATCHES})",
    )
    return parser


# =============================================================================
# The lengths and the settings, read as training reads them
# =============================================================================


def _synthetic_seqlens() -> np.ndarray:
    """2000 lengths, lognormal with a median of about 240 tokens, clipped to [8, 4096]: always the same ones."""
    lengths = np.random.default_rng(0).lognormal(5.5, 0.9, 2000)
    return np.clip(lengths, 8, 4096).astype(np.int64)


def _read_text(path: str) -> str:
    """The text of the file ``path``, or of stdin for ``-``."""
    if path == "-":
        return sys.stdin.read()
    with open(path) as file:
        return file.read()


def _read_seqlens(path: str | None) -> tuple[np.ndarray, str]:
    """Lengths from a .npy file, a text file of one length per line, or ``-`` (stdin), and where they came from;
    synthetic lengths without a path."""
    if path is None:
        return _synthetic_seqlens(), "synthetic lengths"
    name = "stdin" if path == "-" else path
    if path.endswith(".npy"):
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, EOFError) as error:  # a corrupt or non-array file
            raise ValueError(f"cannot read {path} as a .npy array of lengths ({error})") from None
    else:
        lines = [line.strip() for line in _read_text(path).splitlines()]
        bad = next((number for number, line in enumerate(lines, 1) if line and not line.isdigit()), None)
        if bad is not None:
            raise ValueError(
                f"line {bad} of {name} is {lines[bad - 1][:40]!r}, not a whole number; give one length per line"
            )
        array = [int(line) for line in lines if line]
        if not array:
            raise ValueError(f"{name} holds no lengths; give one length per line")
    try:
        return varbatch._as_counts(array), name
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name}: {error}") from None


def _read_config_file(path: str | None) -> dict:
    """The DeepSpeed config in the JSON file ``path`` (none: an empty one)."""
    if not path:
        return {}
    with open(path) as file:
        try:
            return json.load(file)
        except ValueError as error:
            raise ValueError(f"{path} is not valid JSON ({error})") from None


def _options(args: argparse.Namespace, config: dict) -> tuple[dict, dict]:
    """``(plan options, LR options)``: the config's section as training reads it, each flag given replacing its
    value; without --config, varbatch's defaults and a budget of 4096 tokens."""
    if args.config:
        options, lr, _ = varbatch._read_config(config)
    else:
        options, lr = {"max_tokens": 4096}, dict(varbatch._LR_DEFAULTS)
    for key in ("max_tokens", "budget", "order", "packing", "seed"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.padding_free:
        options["padding_free"] = True
    for key in ("lr_scaling_method", "lr_scaling_unit", "lr_scaling_reference"):
        if getattr(args, key) is not None:
            lr[key] = getattr(args, key)
    return options, lr


def _config_count(config: dict, key: str) -> int | None:
    """The config's whole number ``key`` (>= 1), or None where it has none."""
    if config.get(key) is None:
        return None
    return varbatch._check_int(key, config[key], minimum=1)


def _batch_geometry(args: argparse.Namespace, config: dict) -> tuple[int, int, int]:
    """``(train_batch_size, train_micro_batch_size_per_gpu, world size)`` as DeepSpeed resolves them: a missing
    one derived from the others; --effective-batch-size replaces train_batch_size and the accumulation steps,
    --world-size the world size."""
    train = _config_count(config, "train_batch_size")
    micro = _config_count(config, "train_micro_batch_size_per_gpu")
    accumulation = _config_count(config, "gradient_accumulation_steps")
    if args.effective_batch_size:
        train = args.effective_batch_size
        micro = micro or 1  # the config's micro-batch size stays
        accumulation = None
    if args.world_size:
        world = args.world_size
    elif None not in (train, micro, accumulation):
        world = train // (micro * accumulation)
    else:
        world = 1
    if micro is None:
        micro = train // ((accumulation or 1) * world) if train else 1
    if train is None:
        train = micro * (accumulation or 1) * world
    if accumulation is not None:
        fix = f"fix the config, --effective-batch-size or --world-size (world size {world} here)"
        varbatch._check_batch_geometry(train, micro, accumulation, world, fix)
    return train, micro, world


def _settings(args: argparse.Namespace) -> tuple[varbatch._Settings, dict]:
    """The plan's settings (validated) and the LR options that the config and the flags ask for."""
    config = _read_config_file(args.config)
    options, lr = _options(args, config)
    train, micro, world = _batch_geometry(args, config)
    settings = varbatch._Settings.of(
        **options,
        effective_batch_size=train,
        micro_batch_size=micro,
        num_replicas=world,
        same_size=args.pipeline and not options.get("padding_free"),  # flat pipeline rows: one length, any count
        same_length=args.pipeline,
    )
    return settings, lr


def _plan(seqlens: np.ndarray, settings: varbatch._Settings, epoch: int | None) -> varbatch.Plan:
    """The plan of ``epoch`` (default 0), refused where it has no batch, as training refuses it."""
    return varbatch.plan_batches(seqlens, epoch=epoch or 0, **dataclasses.asdict(settings))


def _with_factors(plan: varbatch.Plan, lr: dict) -> dict:
    """The LR options ``lr`` with the plan's LR factors (``factors``, one per batch) and ``B_ref``
    (``reference_value``), computed by the scheduler's rule."""
    unit = varbatch._check_choice("lr_scaling_unit", lr["lr_scaling_unit"], varbatch._LRUnit)
    factors, b_ref = varbatch._lr_factors(
        plan._amounts(unit),
        varbatch._check_reference(lr["lr_scaling_reference"]),
        varbatch._check_lr_method(lr["lr_scaling_method"]),
        plan.effective_batch_size,
    )
    return {**lr, "factors": factors, "reference_value": b_ref}


# =============================================================================
# The table and the JSON
# =============================================================================


def _plural(count: int, word: str, many: str | None = None) -> str:
    """``1 batch``, ``2 batches``: ``many`` is the plural where it is not ``word + "s"``."""
    if count == 1:
        return f"{count} {word}"
    return f"{count} {many or word + 's'}"


def _number(value: float) -> str:
    """Whole numbers as such, else 3 significant digits (one decimal from 100 on, never 1e+03)."""
    if float(value).is_integer():
        return str(int(value))
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.3g}"


def _spread(distribution: dict | None) -> str:
    """``min 1 / median 2 / mean 2.5 / max 4`` (``-`` for none)."""
    if distribution is None:
        return "-"
    return " / ".join(f"{key} {_number(distribution[key])}" for key in ("min", "median", "mean", "max"))


def _format_totals(totals: dict) -> str:
    """`Plan.totals` (plus an optional ``lr_factor`` entry) as lines of text, in the words of the keys.

    Example:
        >>> plan = varbatch.plan_batches([3, 5, 2, 6, 4, 1], 8, effective_batch_size=2)
        >>> print(_format_totals(plan.totals()).splitlines()[3])
        tokens: 21 real / 27 padded = 77.8% efficiency
    """
    big, lr = totals["largest_step_input"], totals.get("lr_factor")
    dropped = ", ".join(f"{count} {reason}" for reason, count in totals["dropped"].items())
    same_length = ", same length" if totals["same_length"] else ""
    bound = "" if totals["budget"] == "padded" or totals["padding_free"] else ": not a bound"
    shape = f"{big['sequences']} x {big['padded_seqlen']}"
    if totals["padding_free"]:
        shape = f"a row of {_plural(big['sequences'], 'sample')}, 1 x {big['padded_seqlen']}"
        same_length = f", padding-free{', rows of one length per batch' if totals['same_length'] else ''}"
    lines = [
        f"epoch {totals['epoch']}: {_plural(totals['batches'], 'batch', 'batches')} of "
        f"{_plural(totals['effective_batch_size'], 'micro-batch', 'micro-batches')} "
        f"({totals['micro_batch_size']} per step input x "
        f"{_plural(totals['gradient_accumulation_steps'], 'accumulation step')} x "
        f"{_plural(totals['num_replicas'], 'rank')}), {totals['microbatches']} micro-batches in all",
        f"steps per epoch: {totals['batches']} optimizer steps, {totals['step_inputs_per_rank']} step inputs per rank",
        f"samples: {totals['samples']} trained, {totals['num_dropped']} dropped ({dropped})",
        f"tokens: {totals['real_tokens']} real / {totals['padded_tokens']} padded = "
        f"{totals['efficiency']:.1%} efficiency",
        f"largest step input: {shape} = {big['tokens']} tokens = "
        f"{big['tokens'] / big['bound']:.2f} x (micro_batch_size {totals['micro_batch_size']} x max_tokens "
        f"{totals['max_tokens']}) (budget {totals['budget']}{same_length}{bound})",
        f"B (sequences per batch): {_spread(totals['batch_size'])}",
        f"sequences per micro-batch: {_spread(totals['microbatch_size'])}",
        f"S (padded seqlen per micro-batch): {_spread(totals['padded_seqlen'])}",
    ]
    if lr is not None:
        lines.append(
            f"LR factor ({lr['method']} rule, B_ref={lr['reference']} = {_number(lr['reference_value'])} "
            f"{lr['unit']}): {_spread(lr)}"
        )
        if varbatch._is_unit_trap(lr["mean"], lr["reference"] == "train_batch_size"):
            lines.append(f"warning: {varbatch._lr_warning(lr['mean'], lr['reference_value'], lr['unit'])}")
    return "\n".join(lines)


def _totals(plan: varbatch.Plan, lr: dict) -> dict:
    """`Plan.totals`, with the distribution of the LR factors and the rule that gave them as ``lr_factor``."""
    reference = lr["lr_scaling_reference"]
    totals = plan.totals()
    totals["lr_factor"] = {
        **varbatch._distribution(lr["factors"]),
        "unit": lr["lr_scaling_unit"],
        "method": str(lr["lr_scaling_method"]),
        "reference_value": lr["reference_value"],
        "reference": "train_batch_size" if reference is None else reference,
    }
    return totals


def _batch_rows(plan: varbatch.Plan, factors: np.ndarray, count: int) -> list[dict]:
    """The first ``count`` batches, each as plain data: its sizes, tokens, padding and LR factor."""
    k, sizes, rows = plan.effective_batch_size, plan.microbatch_sizes(), []
    for b in range(count):
        counts = sizes[b * k : (b + 1) * k]
        padded_seqlens = plan.padded_seqlens[b * k : (b + 1) * k]
        slots = int((counts * padded_seqlens).sum())
        if plan.settings.padding_free:  # one row per step input, its padded seqlen long
            slots = int(padded_seqlens[:: plan.settings.micro_batch_size].sum())
        rows.append(
            {
                "batch": b,
                "sequences": int(plan.batch_sizes[b]),
                "microbatch_sizes": counts.tolist(),
                "padded_seqlens": padded_seqlens.tolist(),
                "real_tokens": int(plan.batch_tokens[b]),
                "padded_tokens": slots,
                "padding": 1 - int(plan.batch_tokens[b]) / slots,
                "lr_factor": float(factors[b]),
            }
        )
    return rows


def _listed(plan: varbatch.Plan, batches: int | None) -> int:
    """How many batches the table lists: --batches (0: all), else `TABLE_BATCHES`, at most the plan's."""
    if batches is None:
        batches = TABLE_BATCHES
    return min(batches, plan.num_batches) or plan.num_batches


def _print_json(plan: varbatch.Plan, lr: dict, rows: list[dict], seqlens: np.ndarray, source: str) -> None:
    """The settings, totals, listed batches and dropped ids, as one JSON object."""
    settings = {
        **dataclasses.asdict(plan.settings),
        "seqlens": source,
        "num_samples": len(seqlens),
        "epoch": plan.epoch,
        **{key: lr[key] for key in varbatch._LR_DEFAULTS},
    }
    report = {
        "settings": settings,
        "totals": _totals(plan, lr),
        "batches": rows,
        "dropped_ids": {reason: ids.tolist() for reason, ids in plan.dropped.items()},
    }
    print(json.dumps(report, indent=2))


def _cell(values: list[int]) -> str:
    """Per-micro-batch values in a table cell: one value when all are equal, else the first six (and a count)."""
    if len(set(values)) == 1:
        return str(values[0])
    text = ",".join(map(str, values[:6]))
    if len(values) > 6:
        text += f",...(+{len(values) - 6})"
    return text


def _table(rows: list[dict], k: int) -> list[str]:
    """The listed batches as lines of right-aligned columns, under a heading line."""
    cells = [("batch", "B", "micro-batches", "B per micro-batch", "padded S", "real tokens", "padding %", "LR factor")]
    for row in rows:
        cells.append(
            (
                str(row["batch"]),
                str(row["sequences"]),
                str(k),
                _cell(row["microbatch_sizes"]),
                _cell(row["padded_seqlens"]),
                str(row["real_tokens"]),
                f"{100 * row['padding']:.1f}",
                f"{row['lr_factor']:.3g}",
            )
        )
    widths = [max(len(line[column]) for line in cells) for column in range(len(cells[0]))]
    return ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)).rstrip() for line in cells]


def _print_table(plan: varbatch.Plan, lr: dict, rows: list[dict], seqlens: np.ndarray, source: str) -> None:
    """What the plan is, its listed batches, its totals and its drops, for a person to read."""
    settings, k = plan.settings, plan.effective_batch_size
    microbatches = "micro-batches" if k > 1 else "micro-batch"
    if settings.padding_free:
        mode = "padding-free (one flat row per step input" + (
            ", one length per batch)" if settings.same_length else ")"
        )
    elif settings.same_length:
        mode = "pipeline (same-size, same-length micro-batches)"
    else:
        mode = "regular (DDP)"
    print(
        f"plan: {len(seqlens)} samples ({source}), max_tokens={settings.max_tokens} ({settings.budget} budget), "
        f"order {settings.order}{', best fit' if settings.best_fit else ''}, {k} {microbatches} per batch, epoch "
        f"{plan.epoch}, {mode}\n"
    )
    print("\n".join(_table(rows, k)))
    if len(rows) < plan.num_batches:
        print(f"... {plan.num_batches - len(rows)} more batches (--batches 0 lists all)")
    print(f"\n{_format_totals(_totals(plan, lr))}")
    for reason, ids in plan.dropped.items():
        if len(ids):
            print(f"dropped as {reason}: {varbatch._format_ids(ids)}")


# =============================================================================
# The picture (--plot)
# =============================================================================


def _shown(plan: varbatch.Plan, num_batches: int) -> list[range]:
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

    k = plan.effective_batch_size
    unit = text * height  # the panel's height in rows; the text's and the gaps' shares are of it
    gaps, ends, y = [], [], 0.0  # the rows' boundaries inside micro-batches and where they end; the next row's top
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
            ids, padded_seqlen = plan.microbatch(j), int(plan.padded_seqlens[j])
            ax.add_patch(Rectangle((0, y), padded_seqlen, len(ids), zorder=3, **PADDING))  # above the rows' gaps
            ax.stairs(seqlens[ids], y + np.arange(len(ids) + 1), orientation="horizontal", fill=True, color=TOKEN)
            ax.text(
                padded_seqlen + 0.02 * longest,
                y + len(ids) / 2,
                f"{len(ids)}x{padded_seqlen}xE, {int(seqlens[ids].sum())} tokens",
                fontsize=7.5 * text,
                va="center",
            )
            gaps.append(y + np.arange(1, len(ids)))
            ends.append(np.full(len(ids) - 1, padded_seqlen))
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


def _extent(plan: varbatch.Plan, num_batches: int) -> tuple[int, float]:
    """The sample rows drawn, and the share of the panel's height that text lines and gaps take."""
    shown = _shown(plan, num_batches)
    rows = sum(len(plan.microbatch(j)) for microbatches in shown for j in microbatches)
    share = sum(LINE * (1 + (plan.effective_batch_size > len(m))) + MICROBATCH_GAP * len(m) + BATCH_GAP for m in shown)
    return rows, share


def _reference_label(lr: dict) -> str:
    """``B_ref`` in words for the LR histogram's axis: ``train_batch_size = 4 (sequences)``."""
    reference = lr["lr_scaling_reference"]
    if reference is None:
        label = f"train_batch_size = {lr['reference_value']:g}"
    elif reference == "mean":
        label = "each plan's mean B"
    else:
        label = f"{reference:g}"
    return f"{label} ({lr['lr_scaling_unit']})"


def _draw_histograms(fig, grid, panels: list[tuple]) -> None:
    """Below the panels: B and the LR factor over the whole epoch, in solid and dashed outlines, so that equal
    ones stay visible."""
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
    ax_lr.axvline(1.0, color="black", linewidth=0.8, linestyle=":")
    for ax, xlabel, heading in (
        (ax_b, "B: sequences per batch", "batch size B over the epoch"),
        (
            ax_lr,
            f"LR factor s(B / B_ref), {lr['lr_scaling_method']} rule, B_ref = {_reference_label(lr)}",
            "LR factor over the epoch (dotted: the configured LR)",
        ),
    ):
        ax.set(xlabel=xlabel, ylabel="batches")
        ax.set_title(heading, fontsize=9.5)
        ax.legend(fontsize=8, frameon=False, loc="upper right")


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
    for column, (heading, plan, lr) in enumerate(panels):
        ax = fig.add_subplot(grid[0, column])
        _draw_plan(ax, plan, seqlens, lr["factors"], num_batches, height, text, longest)
        totals = plan.totals()
        big = totals["largest_step_input"]
        ax.set_title(
            f"{heading}\n{totals['batches']} batches, {totals['efficiency']:.1%} of padded tokens are real, largest "
            f"step input {big['sequences']}x{big['padded_seqlen']} = {big['tokens']} tokens",
            fontsize=9.5,
        )
    fig.axes[0].legend(
        handles=[Patch(facecolor=TOKEN, label="token"), Patch(**PADDING, label="padding")],
        loc="lower right",
        fontsize=8,
        frameon=False,
    )
    _draw_histograms(fig, grid, panels)
    fig.savefig(path)


def _drawn(batches: int | None) -> int:
    """How many batches of each plan are drawn: --batches (0: all), else `PLOT_BATCHES`, at most `MAX_BATCHES`."""
    if batches is None:
        batches = PLOT_BATCHES
    return min(batches or sys.maxsize, MAX_BATCHES)


def _plot(args: argparse.Namespace) -> None:
    """Plans the epoch without and with --pipeline and draws both plans to ``args.plot``."""
    if args.batches is not None and not 0 < args.batches <= MAX_BATCHES:
        print(
            f"{NAME}: drawing the first {MAX_BATCHES} batches of each plan (without --plot, --batches 0 lists them "
            f"all)",
            file=sys.stderr,
        )
    try:
        import matplotlib  # noqa: F401  (only the drawing needs it)
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    settings, lr = _settings(args)
    seqlens, source = _read_seqlens(args.seqlens)  # read once: stdin too
    panels = []
    for pipeline, heading in (
        (False, "regular (DDP): each micro-batch padded to its step input's longest"),
        (True, "pipeline: same-size micro-batches, padded to their batch's longest"),
    ):
        packing = None if pipeline else settings.packing  # a pipeline packs blocks of one size: greedily
        shape = dataclasses.replace(settings, same_size=pipeline, same_length=pipeline, packing=packing)
        plan = _plan(seqlens, shape, args.epoch)
        panels.append((heading, plan, _with_factors(plan, lr)))
    epoch = panels[0][1].epoch
    title = (
        f"{len(seqlens)} samples ({source}), max_tokens={settings.max_tokens} ({settings.budget} budget), order "
        f"{settings.order}, {settings.effective_batch_size} micro-batches per batch ({settings.micro_batch_size} per "
        f"step input x {settings.gradient_accumulation_steps} accumulation x {settings.num_replicas} ranks), epoch "
        f"{epoch}"
    )
    draw(args.plot, panels, seqlens, title, _drawn(args.batches))


# =============================================================================
# The command
# =============================================================================


def _error_line(error: Exception) -> str:
    """An error as one line: a file's name and the system's reason, or the message with its line breaks joined."""
    if isinstance(error, OSError) and error.filename:
        text = f"{error.filename}: {error.strerror}"
    else:
        text = str(error)
    return " ".join(text.split())


def _bad_input(error: Exception) -> int:
    """Prints ``error`` as the command's one line on stderr; the exit code of bad input, 2."""
    print(f"{NAME}: error: {_error_line(error)}", file=sys.stderr)
    return 2


def _planned(args: argparse.Namespace) -> tuple[varbatch.Plan, dict, np.ndarray, str]:
    """The plan the flags ask for, its LR options with the factors, the lengths and where they came from."""
    settings, lr = _settings(args)
    seqlens, source = _read_seqlens(args.seqlens)
    plan = _plan(seqlens, settings, args.epoch)
    return plan, _with_factors(plan, lr), seqlens, source


def _print_command(args: argparse.Namespace) -> int:
    """The table (or with --json the JSON) of the plan on stdout; the exit code."""
    try:
        plan, lr, seqlens, source = _planned(args)
    except BAD_INPUT as error:
        return _bad_input(error)
    # Printed outside the try: a closed stdout (`| head`) is no bad input (see the end of the file).
    rows = _batch_rows(plan, lr["factors"], _listed(plan, args.batches))
    if args.json:
        _print_json(plan, lr, rows, seqlens, source)
    else:
        _print_table(plan, lr, rows, seqlens, source)
    return 0


def _plot_command(args: argparse.Namespace) -> int:
    """The picture of the plan, written to ``args.plot``; the exit code."""
    try:
        _plot(args)
    except BAD_INPUT as error:
        return _bad_input(error)
    print(f"{NAME}: wrote {args.plot}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python plan.py [flags]``: prints the plan (or draws it); returns the exit code (0, or 2 on bad input)."""
    args = _parser().parse_args(argv)
    if args.plot is not None:
        return _plot_command(args)
    return _print_command(args)


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BrokenPipeError:  # stdout closed early (`| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        raise SystemExit(1) from None
