"""Which layer each tensor belongs to, and the order layers come in: the ``layered`` loader's grouping.

Pure functions over tensor names; no I/O. A rule maps a tensor name to its layer:

- the default, Llama/Qwen/Mistral naming: ``model.layers.7.mlp.up_proj.weight`` is in layer
  ``model.layers.7`` (expert tensors too: ``model.layers.7.mlp.experts.3.w1.weight``);
- a regular expression whose first group captures the layer number: the layer is the name up to
  the end of that group (``r"\\bh\\.(\\d+)\\."`` groups GPT-2's ``transformer.h.0.attn...``);
- a callable ``name -> layer key``; a key ending in a number is a numbered layer.

A tensor outside every numbered layer (embeddings, the final norm, the head) forms a layer of its
own module: ``model.embed_tokens.weight`` is in ``model.embed_tokens``. Layers come in this order:
embeddings first (the key's last component contains ``emb``, or is ``wte`` or ``wpe``), then
numbered layers by number, then the other modules, with heads (the last component contains
``head`` or ends in ``_out``) at the very end; ties keep the order the checkpoint stores them in.
Anything else: pass a callable rule.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Union

from weightstream.errors import InvalidOptionError, OptionError
from weightstream.planning.plan import TensorSpec

LayerRule = Union[str, "re.Pattern[str]", Callable[[str], str]]
"""A regular expression (its first group captures the layer number), or a callable name -> layer key."""

DEFAULT_LAYER_PATTERN = re.compile(r"(?:^|\.)layers\.([0-9]+)\.")
"""Llama, Qwen, Mistral (and their MoE variants): ``...layers.<number>.``."""

_TRAILING_NUMBER = re.compile(r"([0-9]+)$")
ASCII_DIGITS = re.compile(r"[0-9]+")
_EMBEDDING = re.compile(r"emb|^wte$|^wpe$")
"""Input embeddings, by the key's last component: embed_tokens, tok_embeddings, word_embeddings, rotary_emb, wte,
wpe."""
_HEAD = re.compile(r"head|_out$")
"""Output heads, by the key's last component: lm_head, embed_out (GPT-NeoX), proj_out."""


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer: its key and its tensors, in the order the plan stores them."""

    key: str
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)


def compile_rule(rule: object) -> re.Pattern[str] | Callable[[str], str]:
    """``rule`` checked and ready: a compiled pattern with a capturing group, or the callable itself.

    Raises:
        InvalidOptionError: a pattern that does not compile or has no group.
        OptionError: neither a pattern nor a callable.

    Example:
        >>> compile_rule(r"\\bblocks\\.(\\d+)\\.").groups
        1
    """
    if callable(rule) and not isinstance(rule, re.Pattern):
        return rule
    if isinstance(rule, str):
        try:
            rule = re.compile(rule)
        except re.error as error:
            raise InvalidOptionError(f"layer_rule {rule!r} is not a regular expression: {error}") from None
    if not isinstance(rule, re.Pattern):
        raise OptionError(
            f"layer_rule must be a regular expression or a callable name -> key, got {type(rule).__name__}"
        )
    if rule.groups < 1:
        raise InvalidOptionError(
            f"layer_rule {rule.pattern!r} needs a group capturing the layer number, e.g. r'layers\\.(\\d+)\\.'"
        )
    return rule


def group_layers(
    tensors: Sequence[TensorSpec], rule: re.Pattern[str] | Callable[[str], str] | None = None
) -> list[Layer]:
    """The layers of ``tensors`` (in stored order) under ``rule`` (default: Llama naming), in layer order.

    Raises:
        InvalidOptionError: the rule's group captured something that is not a number, or a callable
            returned an empty key.
        OptionError: a callable returned something that is not a string.

    Example:
        >>> import torch
        >>> names = ["lm_head.weight", "model.layers.1.mlp.w", "model.embed_tokens.weight", "model.norm.weight"]
        >>> names.append("model.layers.0.mlp.w")
        >>> specs = [TensorSpec(name, torch.uint8, (1,), "f", i, 1) for i, name in enumerate(names)]
        >>> [layer.key for layer in group_layers(specs)]
        ['model.embed_tokens', 'model.layers.0', 'model.layers.1', 'model.norm', 'lm_head']
    """
    rule = DEFAULT_LAYER_PATTERN if rule is None else rule
    members: dict[str, list[TensorSpec]] = {}
    ranks: dict[str, tuple] = {}
    for position, spec in enumerate(tensors):
        key, number = _layer_of(spec.name, rule)
        if key not in members:
            members[key] = []
            ranks[key] = _rank(key, number, position)
        members[key].append(spec)
    return [Layer(key, tuple(members[key])) for key in sorted(members, key=ranks.__getitem__)]


def _layer_of(name: str, rule: re.Pattern[str] | Callable[[str], str]) -> tuple[str, tuple[int, str] | None]:
    """The key of ``name``'s layer, and its number (as :func:`layer_number`) if it is a numbered layer."""
    if isinstance(rule, re.Pattern):
        match = rule.search(name)
        if match is None or match.group(1) is None:
            return _module_of(name), None
        if not ASCII_DIGITS.fullmatch(match.group(1)):
            raise InvalidOptionError(
                f"layer_rule {rule.pattern!r} captured {match.group(1)[:40]!r} from tensor {name[:200]!r}: not a layer "
                "number"
            )
        return name[: match.end(1)], layer_number(match.group(1))
    key = rule(name)
    if not isinstance(key, str):
        raise OptionError(
            f"layer_rule returned {type(key).__name__} for tensor {name!r}; it must return the layer's key, a string"
        )
    if not key:
        raise InvalidOptionError(f"layer_rule returned an empty key for tensor {name!r}")
    trailing = _TRAILING_NUMBER.search(key)
    return key, None if trailing is None else layer_number(trailing.group(1))


def layer_number(digits: str) -> tuple[int, str]:
    """A sort key for a run of ASCII digits that orders like its integer, however long the run (Python's
    ``int`` refuses runs over 4,300 digits): shorter numbers first, then digit by digit.

    Example:
        >>> sorted(["10", "9", "0010"], key=layer_number)
        ['9', '10', '0010']
    """
    significant = digits.lstrip("0") or "0"
    return len(significant), significant


def _module_of(name: str) -> str:
    """``model.norm.weight`` -> ``model.norm``: the module a tensor outside the numbered layers belongs to."""
    return name.rsplit(".", 1)[0] if "." in name else name


def _rank(key: str, number: tuple[int, str] | None, position: int) -> tuple[int, object, int]:
    """Embeddings, then numbered layers by number, then other modules, heads last; ties by position."""
    if number is not None:
        return 1, number, position
    last = key.rsplit(".", 1)[-1]
    if _HEAD.search(last):
        return 2, 1, position
    if _EMBEDDING.search(last):
        return 0, 0, position
    return 2, 0, position
