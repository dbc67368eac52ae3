"""The bubble colours are told apart by lightness (issue 36: the three greys of warm-up, stall and cool-down were
hard to tell apart). CIE L* from sRGB by the standard's own formulas (IEC 61966-2-1 for the transfer curve, CIE 1976
for L*), written here, not taken from the palette's code."""

from __future__ import annotations

import itertools

from reports.palette import CATEGORY_COLOURS


def lightness(hex_colour: str) -> float:
    rgb = [int(hex_colour.lstrip("#")[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    y = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    return 116 * y ** (1 / 3) - 16 if y > (6 / 29) ** 3 else y * (29 / 3) ** 3


def test_bubbles_and_host_differ_in_lightness():
    keys = ("bubble_warmup", "bubble_stall", "bubble_cooldown", "host")
    lum = {k: lightness(CATEGORY_COLOURS[k]) for k in keys}
    assert lightness("#FFFFFF") == 100 and abs(lightness("#777777") - 50.0) < 0.1  # the formula itself
    for a, b in itertools.combinations(keys[:3], 2):
        assert abs(lum[a] - lum[b]) >= 20, (a, b, lum)
    for k in keys[1:3]:  # warm-up and host are both light: they differ in hue instead (blue-grey against beige)
        assert abs(lum[k] - lum["host"]) >= 20, (k, lum)
    assert lum["bubble_warmup"] > lum["bubble_stall"] > lum["bubble_cooldown"]  # the pipeline filling, then draining
