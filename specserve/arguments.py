"""Argument types the commands share: comma-separated lists of numbers, refused by argparse itself
(usage, a one-line reason, exit 2) instead of a traceback from deep inside a benchmark."""

import argparse
import math


def _positive_whole(item: str) -> bool:
    return item.isascii() and item.isdigit() and int(item) > 0


def positive_ints(text: str) -> list[int]:
    """"1,4,16" -> [1, 4, 16]; every item a whole number of at least 1."""
    items = [item.strip() for item in text.split(",")]
    if not all(map(_positive_whole, items)):
        raise argparse.ArgumentTypeError(f"{text!r}: want positive whole numbers separated by commas, as in 1,4,16")
    return [int(item) for item in items]


def positive_int(text: str) -> int:
    """"600" -> 600; a whole number of at least 1."""
    item = text.strip()
    if not _positive_whole(item):
        raise argparse.ArgumentTypeError(f"{text!r}: want one positive whole number, as in 600")
    return int(item)


def temperatures(text: str) -> list[float]:
    """"0,0.7" -> [0.0, 0.7]; every item a number of at least 0."""
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: want temperatures of at least 0 separated by commas, as in 0,0.7")
    return values
