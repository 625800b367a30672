"""Argument checks of the public decode API (``autoregressive_generate``, ``speculative_generate``, the tree
builders), run once where the arguments enter, before any target forward.

Accepted token-id inputs: a 1-D sequence of Python / numpy integers, a 1-D integer tensor or numpy array [T], or
a batch of one row (``[1, T]`` tensor or array, ``[[...]]`` list), as Hugging Face ``input_ids`` come. A
batch of several rows is refused (these decoders run one request at a time; :mod:`dartree.decode.batched` decodes a
list of prompts together, each checked as one). Errors are one line naming the
argument, what was given and the fix: ``TypeError`` for a wrong type, ``ValueError`` for a wrong shape, size,
range or an unknown builder name.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from dartree.base.fields import describe, is_int, is_real
from dartree.decode.builders import BUILDERS, builder_name, check_builder_params
from dartree.models.drafter import DFlashDrafter
from dartree.models.generation import context_length
from dartree.models.heads import CorrectionHead
from dartree.models.target import Target, check_speculative_target
from dartree.models.validate import check_pairing


def _is_row(x: Any) -> bool:
    """True for a nested row of ids (a list / tuple, or a tensor / array with at least one dimension)."""
    return isinstance(x, (list, tuple)) or (hasattr(x, "shape") and hasattr(x, "dtype") and len(x.shape) >= 1)


def token_ids(value: Any, name: str, vocab_size: int | None = None, *, allow_empty: bool = False,
              ordered: bool = True) -> list[int]:
    """Normalise token ids given as a sequence, tensor or array to a list of ints (see the module docstring).

    Args:
        value: [T] or [1, T] integer ids (list, tuple, torch tensor on any device, numpy array).
        name: the argument's name, used in messages.
        vocab_size: V; every id must lie in [0, V) when given.
        allow_empty: accept T = 0.
        ordered: refuse unordered collections (a set or dict): a prompt's order matters, a set of stop ids' not.
    Returns:
        list of T ints.
    Raises:
        TypeError: a string, a float / bool tensor or entry, or another non-integer input.
        ValueError: a batch of more than one row, more than 2 dimensions, no ids (unless allowed), or an id
            outside [0, V).
    """
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} is a {type(value).__name__}; give token ids (tokenize first: "
                        "tokenizer(text)['input_ids'] or chat_prompt_ids(tokenizer, text))")
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)  # numpy arrays and other array-likes
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} is {describe(value)}; give integer token ids") from None
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(f"{name} is {describe(value)}; token ids must be an integer tensor (e.g. torch.long)")
        if value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        elif value.dim() != 1:
            raise ValueError(f"{name} is {describe(value)}; give one prompt as [T] or [1, T], or several prompts as "
                             "a list of prompts (generate([p1, p2, ...]), batched_generate)")
        ids = value.detach().cpu().tolist()
    elif isinstance(value, (set, frozenset, dict)) and ordered:
        raise TypeError(f"{name} is {describe(value)}, which has no order; give the token ids as a list")
    elif isinstance(value, Sequence) or hasattr(value, "__iter__"):
        ids = list(value)
        if ids and _is_row(ids[0]):
            if len(ids) != 1:
                raise ValueError(f"{name} holds {len(ids)} sequences (a batch); give one prompt as a flat list of "
                                 "token ids (this decoder takes one; decode several with "
                                 "dartree.decode.batched.batched_generate)")
            return token_ids(ids[0], name, vocab_size, allow_empty=allow_empty, ordered=ordered)
        for i, t in enumerate(ids):
            if isinstance(t, torch.Tensor) and t.dim() == 0 and not t.is_floating_point() and t.dtype != torch.bool:
                ids[i] = int(t)
            elif not is_int(t):
                raise TypeError(f"{name}[{i}] = {t!r} is {describe(t)}; token ids must be integers")
        ids = [int(t) for t in ids]
    else:
        raise TypeError(f"{name} is {describe(value)}; give token ids as a list of ints or an integer tensor")
    if not ids and not allow_empty:
        raise ValueError(f"{name} is empty; give at least one token id")
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} holds id {bad[0]} outside the target's vocabulary [0, {vocab_size}) "
                             f"({len(bad)} such ids); tokenize with the target's own tokenizer")
    return ids


def _embedding_rows(target) -> int:
    return int(target.embed_tokens.weight.shape[0])


def check_generate_args(target, prompt_ids, *, max_new_tokens, temperature, stop_ids, generator) -> tuple[list, list]:
    """Check the arguments shared by both decoders; returns (prompt ids [T] as ints, stop ids as ints).

    Args:
        target: a :class:`~dartree.models.target.Target`.
        prompt_ids: [T] or [1, T] token ids (see :func:`token_ids`).
        max_new_tokens: integer >= 0.
        temperature: finite real >= 0.
        stop_ids: token ids (any sequence / set / tensor, possibly empty), one int, or None (no stop id).
        generator: None or a ``torch.Generator`` on the target's device type.
    Raises:
        TypeError: ``target`` is not a dartree Target (a Hugging Face model must be wrapped), or an argument has
            the wrong type (named).
        ValueError: empty / batched prompt, an id outside the vocabulary, negative max_new_tokens, a prompt that
            with max_new_tokens does not fit the target's context (:func:`check_context`), a negative or
            non-finite temperature, or a generator on another device type.
    """
    if not isinstance(target, Target):
        raise TypeError(f"target is {describe(target)}, not a dartree Target; load it with "
                        "dartree.models.target.load_target(...) or wrap a model: Target(model, tokenizer, layer_ids)")
    prompt = token_ids(prompt_ids, "prompt_ids", _embedding_rows(target))
    if not is_int(max_new_tokens):
        raise TypeError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    check_context(target, len(prompt), max_new_tokens)
    if not is_real(temperature):
        raise TypeError(f"temperature={temperature!r} must be a real number >= 0 (0: greedy)")
    if not math.isfinite(float(temperature)) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0: greedy)")
    stop_ids = () if stop_ids is None else stop_ids
    stops = token_ids([stop_ids] if is_int(stop_ids) else stop_ids, "stop_ids", target.vocab_size, allow_empty=True,
                      ordered=False)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator is {describe(generator)}; give a torch.Generator (or None)")
        if generator.device.type != target.device.type:
            raise ValueError(f"generator is on {generator.device} but the target samples on {target.device}; "
                             f"create it there: torch.Generator(device={str(target.device)!r}).manual_seed(seed)")
    return prompt, stops


def check_context(target, prompt_len: int, max_new_tokens: int, what: str = "prompt_ids",
                  fix: str = "lower max_new_tokens") -> None:
    """Refuse a decode that would run past the target's context (:func:`dartree.models.generation.context_length`):
    ``prompt_len + max_new_tokens`` positions must fit in it (a target without a context length passes).

    Args:
        target: a :class:`~dartree.models.target.Target`.
        prompt_len: the prompt's length in tokens. max_new_tokens: the decode's length cap in tokens.
        what: the prompt's name in the message (``prompt_ids``, or a data set's prompt such as ``gsm8k:3``).
        fix: how the caller lowers the length cap (``lower max_new_tokens``, ``lower --max-new-tokens``).
    Raises:
        ValueError: one line naming the prompt, its length, the positions needed, the context and the fix.
    """
    limit = context_length(target)
    if limit is None or prompt_len + max_new_tokens <= limit:
        return
    room = (f"{fix} to at most {limit - prompt_len} or shorten the prompt" if prompt_len < limit else
            f"shorten the prompt to at most {limit - max_new_tokens} tokens" if max_new_tokens < limit else
            f"{fix} below {limit} and shorten the prompt")
    raise ValueError(f"{what} has {prompt_len} tokens; with max_new_tokens={max_new_tokens} the decode needs "
                     f"{prompt_len + max_new_tokens} positions, over the target's context of {limit} "
                     f"(max_position_embeddings): {room}")


def check_prompt_set(target, prompt_ids: list[list[int]], labels: list[str], max_new_tokens: int, depth: int = 0,
                     fix: str = "lower --max-new-tokens") -> None:
    """The checks every program applies to a set of prompts before it loads more, calibrates or decodes (eval, bench,
    the campaign's evaluations): each prompt plus ``max_new_tokens`` fits the target's context
    (:func:`check_context`), and, for a speculative decode reaching ``depth`` tokens past the committed ones, the
    target's rope and cache layers allow it (:func:`dartree.models.target.check_speculative_target`).

    Args:
        target: a :class:`~dartree.models.target.Target`. prompt_ids: [T_i] id lists. labels: one name per prompt
            for the message (``gsm8k:3``). max_new_tokens: the decode's length cap. depth: the deepest tree node or
            lookup token (0: AR only). fix: how the caller lowers the length cap.
    Raises:
        ValueError: one line naming the first prompt or target that does not fit, and the fix.
    """
    for ids, label in zip(prompt_ids, labels):
        check_context(target, len(ids), max_new_tokens, f"prompt {label}", fix)
    if depth > 0 and prompt_ids:
        check_speculative_target(target, max(map(len, prompt_ids)) + max_new_tokens + depth)


def check_lookup(lookup, lookup_ngram=3) -> None:
    """Check the prompt-lookup arguments of ``speculative_generate`` (and the API's ``generate``).

    Args:
        lookup: an integer >= 0, the tokens of the prompt-lookup chain grafted per round (0: off).
        lookup_ngram: an integer >= 1, the longest n-gram the lookup matches.
    Raises:
        TypeError: a value that is not an integer (``bool`` included), named.
        ValueError: ``lookup`` < 0 or ``lookup_ngram`` < 1, named.
    """
    for name, value, low, what in (("lookup", lookup, 0, "the prompt-lookup chain's tokens per round, 0: off"),
                                   ("lookup_ngram", lookup_ngram, 1, "the longest n-gram the lookup matches")):
        if not is_int(value):
            raise TypeError(f"{name} must be an int >= {low}, got {value!r} ({describe(value)}): {what}")
        if value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}: {what}")


def check_speculative_args(target, drafter, head, *, builder, budget, builder_params) -> None:
    """Check the arguments only ``speculative_generate`` takes, before the prefill.

    Args:
        drafter: a :class:`~dartree.models.drafter.DFlashDrafter` fitting ``target``.
        head: a :class:`~dartree.models.heads.CorrectionHead` fitting both.
        builder: a registered tree-builder name or alias (:data:`dartree.decode.builders.BUILDERS`,
            ``BUILDER_ALIASES``).
        budget: None, ``"auto"`` (the cost-model budget) or an integer >= 0.
        builder_params: None or a dict of the parameters the registered builders declare (``k``, ``width``,
            ``beta``, ``children``, ``backend``; :func:`dartree.decode.builders.check_builder_params`) with valid
            values.
    Raises:
        TypeError: a wrong type (for instance a loaded ``DraftModel`` passed as the drafter), or an unknown
            builder parameter.
        ValueError: an unknown builder name (the registered ones and their aliases listed:
            :func:`dartree.decode.builders.builder_name`), drafter / head / target mismatch
            (:func:`dartree.models.validate.check_pairing`), target capture layers that differ from the drafter's, a
            negative budget or an out-of-range parameter.
    """
    if not isinstance(drafter, DFlashDrafter):
        hint = "; a loaded checkpoint is passed as dm.drafter, dm.head" if hasattr(drafter, "drafter") else ""
        raise TypeError(f"drafter is {describe(drafter)}, not a DFlashDrafter{hint}")
    if not isinstance(head, CorrectionHead):
        hint = "; a loaded checkpoint is passed as dm.drafter, dm.head" if hasattr(head, "head") else ""
        raise TypeError(f"head is {describe(head)}, not a CorrectionHead (IdentityHead() for plain DFlash){hint}")
    check_pairing(target, drafter, head)
    if list(target.layer_ids) != list(drafter.cfg.target_layer_ids):
        raise ValueError(
            f"target captures layers {target.layer_ids} but the drafter needs {drafter.cfg.target_layer_ids}; "
            "call target.set_layer_ids(drafter.cfg.target_layer_ids)"
        )
    if not isinstance(builder, str):
        raise TypeError(f"builder is {describe(builder)}; give a builder name, one of {sorted(BUILDERS)}")
    builder_name(builder)  # an unknown name: ValueError listing the builders and their aliases
    if budget is not None and budget != "auto":
        if not is_int(budget):
            raise TypeError(f"budget={budget!r} must be an integer >= 0 (tree nodes per round), 'auto' or None")
        if budget < 0:
            raise ValueError(f"budget={budget} must be >= 0 (tree nodes per round; None: one per proposal)")
    check_builder_params(builder_params)
