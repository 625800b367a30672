"""A target's own generation settings, read where a target enters (``decode/eval.py``, the training data stage).

* :func:`stop_ids`: the token ids at which the target's own ``generate`` stops. Instruct models of several
  families name more than one end id (``generation_config.eos_token_id`` is a list in Llama-3, Gemma and Phi-3
  instruct models), and the tokenizer's ``eos_token_id`` may be yet another.
* :func:`sampling_settings`: the ``generation_config`` settings that change a sample beyond softmax(logits / T)
  (``top_k``, ``top_p``, ...). dartree's decoders sample softmax(logits / T) exactly and apply none of them, so a
  caller refuses them by name or records that they were ignored.
* :func:`context_length`: the positions the target was built for (``max_position_embeddings``).
"""

from __future__ import annotations

from typing import Any

from dartree.base.fields import is_int, is_real

# generation_config fields that change what a sample at T > 0 is, each with the value under which it does nothing
# (None, the transformers default, also means off). repetition_penalty changes the greedy token too.
SAMPLING_NEUTRAL = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repetition_penalty": 1.0}


def _as_ids(value: Any, where: str, vocab_size: int) -> list[int]:
    """``value`` (None, one id, or a list / tuple of ids) as a list of ints.

    Raises:
        ValueError: an entry that is not an integer token id in [0, vocab_size), named with ``where``.
    """
    items = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    for v in items:
        if not is_int(v) or not 0 <= int(v) < vocab_size:
            raise ValueError(f"{where}={value!r} holds {v!r} ({type(v).__name__}): end ids must be integer token ids "
                             f"in [0, {vocab_size}); fix the target's generation_config.json / tokenizer_config.json")
    return [int(v) for v in items]


def generation_config(target) -> Any:
    """The target model's ``generation_config`` (a transformers ``GenerationConfig``), or its model config when the
    model has none (both carry ``eos_token_id``)."""
    return getattr(target.model, "generation_config", None) or target.config


def stop_ids(target) -> list[int]:
    """The token ids at which the target's own ``generate`` stops, for every decode and regeneration of it.

    The union of ``generation_config.eos_token_id`` (one id or a list; the model config's when the model has no
    generation config) and the tokenizer's ``eos_token_id`` (when there is a tokenizer), in that order.

    Args:
        target: a :class:`~dartree.models.target.Target` (V = ``target.vocab_size`` lm_head rows).
    Returns:
        distinct int ids in [0, V); [] when neither names an end id (decodes then run to their length cap).
    Raises:
        ValueError: an end id that is not an integer in [0, V) (named with its field and value).
    """
    ids = _as_ids(getattr(generation_config(target), "eos_token_id", None), "generation_config.eos_token_id",
                  target.vocab_size)
    tok = target.tokenizer
    if tok is not None:
        ids += _as_ids(getattr(tok, "eos_token_id", None), "tokenizer.eos_token_id", target.vocab_size)
    return list(dict.fromkeys(ids))


def _acts(name: str, value: Any) -> bool:
    """True when ``generation_config.<name> = value`` changes the sampled distribution (:data:`SAMPLING_NEUTRAL`)."""
    return value is not None and is_real(value) and float(value) != SAMPLING_NEUTRAL[name]


def sampling_settings(target) -> dict:
    """The settings of the target's ``generation_config`` that change a sample beyond softmax(logits / T).

    Args:
        target: a :class:`~dartree.models.target.Target`.
    Returns:
        {name: value} for each of :data:`SAMPLING_NEUTRAL` set to a value that acts, e.g. ``{"top_k": 20,
        "top_p": 0.8}``; {} when none does. dartree's decoders apply none of them.
    """
    gen = generation_config(target)
    return {n: getattr(gen, n) for n in SAMPLING_NEUTRAL if _acts(n, getattr(gen, n, None))}


def context_length(target) -> int | None:
    """The target's context in tokens (``config.max_position_embeddings``); None when its config gives none."""
    limit = getattr(target.config, "max_position_embeddings", None)
    return int(limit) if is_int(limit) and limit > 0 else None


def sampling_problem(settings: dict, temperature: float, ignore: bool, *,
                     ignore_hint: str = "--ignore-generation-config", zero_hint: str = "--temperature 0") -> str | None:
    """Why a run cannot sample as the target's own ``generate`` would, or None when it may go ahead.

    The decoders take the argmax at T = 0 and ``softmax(logits / T)`` samples at T > 0, exactly. The target's
    generation-config settings (:func:`sampling_settings`: top_k, top_p, min_p, typical_p act at T > 0;
    repetition_penalty at any T) would change that distribution, so a run where any of them acts is refused
    unless the caller chose to ignore them.

    Args:
        settings: :func:`sampling_settings` of the target. temperature: the run's T >= 0.
        ignore: the caller asked to decode without the settings (the CLI's ``--ignore-generation-config``).
        ignore_hint, zero_hint: how the caller spells "ignore them" and "use T = 0" in the message.
    Returns:
        one line naming the acting settings and both fixes, or None.
    """
    acting = {k: v for k, v in settings.items() if temperature > 0 or k == "repetition_penalty"}
    if not acting or ignore:
        return None
    named = ", ".join(f"{k}={v}" for k, v in acting.items())
    return (f"the target's generation_config sets {named}, which dartree's decoders do not apply (they take "
            f"{'softmax(logits / T) samples' if temperature > 0 else 'the argmax'} exactly); pass "
            f"{ignore_hint} to decode without them"
            + (f", or {zero_hint}" if temperature > 0 and "repetition_penalty" not in acting else ""))
