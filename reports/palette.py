"""The report's colours, in one place, so every figure speaks the same visual language.

Based on the Okabe–Ito palette (Okabe & Ito 2008, "Color Universal Design"; also Wong 2011, Nature Methods 8:441),
which stays distinguishable under the common forms of colour-vision deficiency. It has eight colours; the three
bubble categories use greys, since bubbles are "absence of work" and should recede, told apart by lightness alone
(which every form of colour-vision deficiency keeps): CIE L* about 85, 62 and 35, at least 20 apart from each other
and from the host's beige (tests/reports/test_palette.py). The three greys of 87/70/50 L* were hard to tell apart in a
stacked bar (issue 36); warm-up also takes a slight blue tint so it does not read as the host's beige.
"""

from __future__ import annotations

from traceana.core import schema

BLACK = "#000000"
ORANGE = "#E69F00"
SKY_BLUE = "#56B4E9"
BLUISH_GREEN = "#009E73"
YELLOW = "#F0E442"
BLUE = "#0072B2"
VERMILLION = "#D55E00"
REDDISH_PURPLE = "#CC79A7"

# One colour per attribution category (traceana.core.schema.CATEGORIES) and per timeline kind.
CATEGORY_COLOURS = {
    "forward": BLUE,
    "backward": ORANGE,
    "backward_input": "#F5C46B",  # zero-bubble's split backward: a light and a dark shade of the backward's orange
    "backward_weight": "#A87400",
    "recompute": REDDISH_PURPLE,
    "optimizer": BLUISH_GREEN,
    "other_compute": SKY_BLUE,
    "p2p": VERMILLION,
    "bpipe": BLACK,
    "collective": YELLOW,
    "bubble_warmup": "#CFD8E0",
    "bubble_stall": "#9A9A9A",
    "bubble_cooldown": "#525252",
    "host": "#E5D8BD",
}

# Human labels for categories, used in legends, hovers and tables: traceana.core.schema's, the CLI's too.
CATEGORY_LABELS = schema.CATEGORY_LABELS

# Runs in an A/B comparison: first run (usually the baseline) blue, second (e.g. BPipe) orange, then the rest.
RUN_COLOURS = (BLUE, ORANGE, BLUISH_GREEN, REDDISH_PURPLE, SKY_BLUE, VERMILLION, YELLOW, BLACK)


def run_colour(i: int) -> str:
    return RUN_COLOURS[i % len(RUN_COLOURS)]
