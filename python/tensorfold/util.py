"""Small helpers the whole Python layer shares: what counts as an integer or a number, the
argument checks (a wrong type is a TypeError, a bad value a ValueError, and both messages
name the valid range), sizes and counts written for people, and file hashes.

It imports nothing heavy (no numpy, no native core): tensorfold.tokenizer, the chat
template sandbox and the command line all import it. numpy scalars are still recognised,
through the `numbers` ABCs numpy registers them with.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import numbers
import os
import sys
from typing import Any

INT32_MAX = 2**31 - 1


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (e.g. top_k=2.5, temperature="hot", messages="hi"). It is a
    TypeError; it is also a ValueError, so that code written when these were ValueErrors
    (`except ValueError`) still catches them. A right type with a bad value is a plain
    ValueError."""


# -- what a value is ---------------------------------------------------------------------
def is_int(v: Any) -> bool:
    """A Python or numpy integer; bools are not (a flag is not a count or an id)."""
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def is_number(v: Any) -> bool:
    """A Python or numpy integer or float; bools are not."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def is_bool(v: Any) -> bool:
    """True or False, Python's or numpy's."""
    if isinstance(v, bool):
        return True
    np = sys.modules.get("numpy")  # a numpy bool exists only once numpy is imported
    return np is not None and isinstance(v, np.bool_)


# -- argument checks ---------------------------------------------------------------------
def range_text(kind: str, lo: float, hi: float, lo_open: bool = False) -> str:
    """How a range is stated everywhere: 'an integer in [0, 2147483647]', 'a finite number
    >= 0', 'a finite number in (0, 1]' (kind "int" or "float")."""
    if kind == "int":
        return f"an integer in [{lo}, {hi}]"
    if math.isfinite(hi):
        return f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    return f"a finite number {'>' if lo_open else '>='} {lo:g}"


def int_in(name: str, v: Any, lo: int, hi: int = INT32_MAX, note: str = "") -> int:
    """`v` as an int when it is an integer in [lo, hi]; else ArgumentTypeError (wrong type) or
    ValueError (out of range), naming `name`, the range and `note` (e.g. ' (0 = off)')."""
    if not is_int(v):
        raise ArgumentTypeError(f"{name} must be {range_text('int', lo, hi)}{note}, got {v!r} ({type(v).__name__})")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be {range_text('int', lo, hi)}{note}, got {v!r}")
    return int(v)


def float_in(name: str, v: Any, lo: float, hi: float = math.inf, lo_open: bool = False, note: str = "") -> float:
    """`v` as a float when it is a finite number in the range (NaN, infinities and ints beyond
    float range are out of it); else ArgumentTypeError or ValueError, as int_in."""
    rng = range_text("float", lo, hi, lo_open)
    if not is_number(v):
        raise ArgumentTypeError(f"{name} must be {rng}{note}, got {v!r} ({type(v).__name__})")
    try:
        f = float(v)
    except OverflowError:  # an int beyond float range
        f = math.nan
    if not (math.isfinite(f) and (lo < f if lo_open else lo <= f) and f <= hi):
        raise ValueError(f"{name} must be {rng}{note}, got {v!r}")
    return f


def parse_in(text: str, kind: str, lo: float, hi: float = INT32_MAX, lo_open: bool = False) -> int | float:
    """A command-line value: `text` as an int (kind "int") or a finite float in the range;
    else argparse.ArgumentTypeError ('must be an integer in [1, 2147483647], got 0', 'expected
    a number, got 'x''), which argparse prefixes with the option's name."""
    if kind == "int":
        try:
            v: int | float = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        ok = lo <= v <= hi
    else:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        raise argparse.ArgumentTypeError(f"must be {range_text(kind, lo, hi, lo_open)}, got {text}")
    return v


def check_bool(name: str, v: Any) -> bool:
    """`v` when it is True or False (numpy's too); else ArgumentTypeError."""
    if not is_bool(v):
        raise ArgumentTypeError(f"{name} must be True or False, not {type(v).__name__}")
    return bool(v)


# -- for people --------------------------------------------------------------------------
def human_size(n: int | float, gib_decimals: int = 2) -> str:
    """A size in the unit that shows it: GiB from 1 GiB, MiB from 1 MiB, KiB from 1 KiB, else
    bytes ('217.00 GiB', '93.8 MiB', '512 B')."""
    if n >= 2**30:
        return f"{n / 2**30:.{gib_decimals}f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    if n >= 2**10:
        return f"{n / 2**10:.1f} KiB"
    return f"{int(n)} B"


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """'1 token', '2 tokens', '3 entries' (with plural='entries')."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


# -- files -------------------------------------------------------------------------------
_HASH_CHUNK = 1 << 24


def sha256_file(*paths: str | os.PathLike) -> str:
    """The sha256 (hex) of a file's bytes, or of several files' bytes one after the other
    (a split model), read in chunks."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()
