"""Prompts through the target's chat template: one user turn, a chat's messages, or plain text for a base model.

Every tool renders prompts here (the evaluation harness, training data, the Python API), so a prompt is the same
token ids wherever it is fed to the target. Template options (e.g. Qwen3's ``{"enable_thinking": False}``) are
passed to ``apply_chat_template`` as template variables.
"""

from __future__ import annotations

import inspect


def check_chat_template(tokenizer, template_kwargs: dict | None = None, fix: str = "") -> None:
    """Refuse, before any prompt is rendered, a tokenizer without a chat template and template options that
    ``apply_chat_template`` cannot take.

    Args:
        tokenizer: a Hugging Face tokenizer.
        template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``), or None.
        fix: appended to the no-template message (how the caller feeds plain text instead).
    Raises:
        ValueError: no tokenizer, no chat template (a base model), ``template_kwargs`` not a dict with string keys,
            or a key that is one of ``apply_chat_template``'s own parameters (``tokenize``, ...); one line each.
    """
    if tokenizer is None:
        raise ValueError("the target has no tokenizer to render the chat template with")
    if hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:  # (a stub without the field has one)
        raise ValueError("the target's tokenizer has no chat template (a base model?)" + (f"; {fix}" if fix else ""))
    kwargs = {} if template_kwargs is None else template_kwargs
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat template options {kwargs!r} must be an object of named values, e.g. "
                         '{"enable_thinking": false}')
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    own = sorted(k for k in kwargs if k in params and params[k].kind is not inspect.Parameter.VAR_KEYWORD)
    if own:
        raise ValueError(f"chat template options {own} are apply_chat_template's own arguments, set by dartree; "
                         "give template variables only (e.g. enable_thinking)")


def chat_prompt_ids(tokenizer, text: str, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of one user turn through the tokenizer's chat template, with the generation prompt added.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template. text: the user turn.
        template_kwargs: extra template variables passed to ``apply_chat_template`` (e.g.
            ``{"enable_thinking": False}`` for Qwen3), or None.
    Returns:
        [T] int token ids.
    Raises:
        ValueError: no chat template, or unusable ``template_kwargs`` (:func:`check_chat_template`).
    """
    check_chat_template(tokenizer, template_kwargs)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def messages_prompt_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a chat through the tokenizer's chat template, with the generation prompt added (the many-turn
    form of :func:`chat_prompt_ids`, which renders a single user turn the same way).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template. messages: ``[{"role": str, "content": str}, ...]``.
        template_kwargs: extra template variables passed to ``apply_chat_template``, or None.
    Returns:
        [T] int token ids.
    Raises:
        ValueError: no chat template, or unusable ``template_kwargs``
            (:func:`check_chat_template`).
    """
    check_chat_template(tokenizer, template_kwargs)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **(template_kwargs or {}))
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def text_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as plain text, no chat template (the tokenizer adds its own special tokens, e.g. a
    BOS): the prompt of a base model. Returns [T] int token ids."""
    return list(tokenizer(text)["input_ids"])
