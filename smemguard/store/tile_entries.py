"""The entries of the decision file's ``tiles`` table, which declared wrappers fill
(:mod:`smemguard.engine.wrapper_tiles`): their own fields, and the one rule saying whether recovery could have
produced the tiles an entry holds (a halving of the tiles the wrapper answered), checked where an entry is imported
or read (against the tiles it says were answered) and where it is applied (against those the wrapper answers)."""

from __future__ import annotations

from ..facts.untrusted import TEXT, Expect, integer, shown

_TILE = Expect("a tile from 1 to 65536", lambda value: integer(1).test(value) and value <= 2**16)
#: A tiles entry's own fields: the tiles that fit (``value``), their names (``tile``: ``BLOCK_M,BLOCK_N``), and the
#: tiles the wrapper answered (``from_config``: ``BLOCK_M=128 BLOCK_N=64``).
FIELDS = {"value": Expect("a tile from 1 to 65536, or a list of 1 to 8 of them", lambda value: _TILE.test(value)
                          or (type(value) is list and 1 <= len(value) <= 8 and all(map(_TILE.test, value)))),
          "tile": Expect("the tiles' names, separated by commas", lambda value: isinstance(value, str)
                         and all(name.isidentifier() for name in value.split(","))),
          "from_config": TEXT}


def label(names, values) -> str:
    """``name=value`` pairs joined by spaces: how records, log lines and an entry's ``from_config`` and ``final``
    write tiles (``BLOCK_M=128 BLOCK_N=64``, read back by :func:`problems`), and log lines a shape class."""
    return " ".join(f"{name}={value}" for name, value in zip(names, values))


def halved(tiles: tuple, smallest: int) -> tuple | None:
    """The next tiles a declared wrapper tries after ``tiles`` did not fit: every tile equal to the largest halved
    (equal tiles stay equal, a smaller one waits), or None when that would go below ``smallest``."""
    largest = max(tiles)
    if largest // 2 < smallest:
        return None
    return tuple(tile // 2 if tile == largest else tile for tile in tiles)


def not_a_halving(answered: tuple, tiles: tuple, smallest: int = 1) -> str | None:
    """Why recovery could not have produced ``tiles`` from the tiles a wrapper ``answered`` (None when it could:
    they are one of the halvings of :func:`halved`)."""
    halving = answered
    while (halving := halved(halving, smallest)) is not None:
        if halving == tiles:
            return None
    return (f"the tiles {list(tiles)} are not a halving of {list(answered)}, the tiles the wrapper answered (the "
            f"largest halved together{f', none below {smallest}' if smallest > 1 else ''})")


def stored(entry: dict) -> tuple:
    """The tiles an entry holds (one tile as a number, as entries written before several)."""
    return (entry["value"],) if type(entry["value"]) is int else tuple(entry["value"])


def problems(entry: dict) -> list[str]:
    """Why recovery could not have produced the tiles of ``entry`` (whose :data:`FIELDS` are checked) from those
    it says the wrapper answered; empty when it could."""
    given = [token.partition("=") for token in entry["from_config"].split()]
    if [name for name, _, _ in given] != entry["tile"].split(",") or not all(
            value.isascii() and value.isdigit() and len(value) <= 5 for _, _, value in given):
        return [f"'from_config' is {shown(entry['from_config'], 80)}, expected each of {entry['tile']} with its tile"]
    why = not_a_halving(tuple(int(value) for _, _, value in given), stored(entry))
    return [why] if why is not None else []
