"""Per-rank pre-sharded checkpoints: the file naming vLLM's and SGLang's ``sharded_state`` use.

Rank ``r`` of a tensor-parallel engine saves its own state dict as ``model-rank-{r}-part-{p}.safetensors``
(parts split at a size limit, numbered from 0); with pipeline parallelism vLLM names them
``model-pp-{pp_rank}-tp-{tp_rank}-part-{p}.safetensors``. A pattern may use ``{rank}`` or both
``{pp_rank}`` and ``{tp_rank}``, must use ``{part}``, and names a file in the directory itself.
A rank is an ``int`` for ``{rank}`` patterns and a ``(pp_rank, tp_rank)`` pair for the others;
so is a world size (``(pp_size, tp_size)``).
"""

from __future__ import annotations

import re
import string

from weightstream.errors import InvalidOptionError

DEFAULT_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
PP_PATTERN = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
KNOWN_PATTERNS = (DEFAULT_PATTERN, PP_PATTERN)
"""What a directory without a manifest is tried against, in this order."""

Rank = int | tuple[int, int]
"""``{rank}``: the rank; ``{pp_rank}``/``{tp_rank}``: (pp_rank, tp_rank). World sizes take the same shapes."""

_FIELDS = {"rank", "pp_rank", "tp_rank", "part"}
MAX_INDEX_DIGITS = 9
"""A rank or part number in a file name has at most this many digits; a longer run names no file of ours
(and would cost Python's integer parser, which refuses runs over 4,300 digits, a bare ValueError)."""


class ShardPattern:
    """A checked file-name pattern: names files for a rank and part, and recognises them.

    Example:
        >>> pattern = ShardPattern(DEFAULT_PATTERN)
        >>> pattern.name(1, 0)
        'model-rank-1-part-0.safetensors'
        >>> pattern.parse("model-rank-12-part-3.safetensors")
        (12, 3)
        >>> ShardPattern(PP_PATTERN).parse("model-pp-1-tp-0-part-2.safetensors")
        ((1, 0), 2)
    """

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str):
            raise InvalidOptionError(f"a shard pattern must be a string, got {type(pattern).__name__}")
        try:
            parsed = list(string.Formatter().parse(pattern))
        except ValueError as error:
            raise InvalidOptionError(f"shard pattern {pattern!r} is not a format string: {error}") from None
        fields = [field for _, field, _, _ in parsed if field is not None]
        decorated = [
            f"{{{field}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}"
            for _, field, spec, conversion in parsed
            if field is not None and (spec or conversion)
        ]
        if decorated:
            raise InvalidOptionError(
                f"shard pattern {pattern!r} uses {decorated[0]}; placeholders take no format spec or conversion"
            )
        unknown = sorted(set(fields) - _FIELDS)
        if unknown:
            raise InvalidOptionError(
                f"shard pattern {pattern!r} uses {{{unknown[0]}}}; the placeholders are {{rank}} or {{pp_rank}} and "
                f"{{tp_rank}}, and {{part}}"
            )
        if fields.count("part") != 1 or len(fields) != len(set(fields)):
            raise InvalidOptionError(
                f"shard pattern {pattern!r} must use {{part}} once and each placeholder at most once"
            )
        if (
            "rank" in fields
            and {"pp_rank", "tp_rank"} & set(fields)
            or ("rank" not in fields and not {"pp_rank", "tp_rank"} <= set(fields))
        ):
            raise InvalidOptionError(
                f"shard pattern {pattern!r} must use either {{rank}} or both {{pp_rank}} and {{tp_rank}}"
            )
        if "/" in pattern or pattern.startswith(".") or not pattern.endswith(".safetensors"):
            raise InvalidOptionError(
                f"shard pattern {pattern!r} must name a .safetensors file in the directory itself (no '/', no leading "
                "'.')"
            )
        self.pattern = pattern
        self.pipelined = "rank" not in fields
        regex = ""
        for literal, field, _, _ in string.Formatter().parse(pattern):
            regex += re.escape(literal)
            if field is not None:
                regex += rf"(?P<{field}>0|[1-9][0-9]{{0,{MAX_INDEX_DIGITS - 1}}})"
        self._regex = re.compile(regex)

    def check_rank(self, rank: object, what: str = "rank") -> Rank:
        """``rank`` (or a world size) in the shape this pattern needs, or ``InvalidOptionError``."""
        if self.pipelined:
            if not (isinstance(rank, tuple) and is_rank(rank)):
                raise InvalidOptionError(
                    f"{what} must be a (pp, tp) pair of non-negative integers for pattern {self.pattern!r}, got "
                    f"{rank!r}"
                )
            return rank
        if not _is_index(rank):
            raise InvalidOptionError(
                f"{what} must be a non-negative integer for pattern {self.pattern!r}, got {rank!r}"
            )
        return rank

    def name(self, rank: Rank, part: int) -> str:
        """The file name of ``rank``'s part ``part``."""
        if self.pipelined:
            return self.pattern.format(pp_rank=rank[0], tp_rank=rank[1], part=part)
        return self.pattern.format(rank=rank, part=part)

    def parse(self, name: str) -> tuple[Rank, int] | None:
        """``(rank, part)`` of a file name this pattern makes, or None."""
        match = self._regex.fullmatch(name)
        if match is None:
            return None
        rank = (int(match["pp_rank"]), int(match["tp_rank"])) if self.pipelined else int(match["rank"])
        return rank, int(match["part"])


def is_rank(value: object) -> bool:
    """Whether ``value`` has a rank's shape: a non-negative integer, or a (pp, tp) pair of them."""
    pair = isinstance(value, tuple) and len(value) == 2 and all(_is_index(part) for part in value)
    return pair or _is_index(value)


def check_in_world(rank: Rank, world_size: Rank) -> None:
    """Raise ``InvalidOptionError`` unless ``rank`` is one of the ranks of ``world_size``, of the same shape.

    Example:
        >>> check_in_world(2, 2)
        Traceback (most recent call last):
        ...
        weightstream.errors.InvalidOptionError: rank 2 is not in a world of size 2
    """
    if isinstance(rank, tuple) != isinstance(world_size, tuple):
        raise InvalidOptionError(
            f"rank {rank!r} and world_size {world_size!r} must both be integers or both (pp, tp) pairs"
        )
    if not in_world(rank, world_size):
        raise InvalidOptionError(f"{describe(rank)} is not in a world of size {world_size!r}")


def in_world(rank: Rank, world_size: Rank) -> bool:
    """Whether ``rank`` is one of the ranks of ``world_size`` (both of the same shape)."""
    if isinstance(rank, tuple):
        return all(0 <= r < w for r, w in zip(rank, world_size, strict=True))
    return 0 <= rank < world_size


def describe(rank: Rank) -> str:
    """``rank 3`` or ``pp_rank 1, tp_rank 0``, for messages and file names."""
    return f"pp_rank {rank[0]}, tp_rank {rank[1]}" if isinstance(rank, tuple) else f"rank {rank}"


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
