"""Load a target and a drafter once, then generate with speculative decoding: :func:`load` and
:class:`SpeculativeDecoder`.

What the library does for one request, behind one call: the prompt through the target's chat template, the drafter's
block and the correction head's scores into a draft tree (DARTree-pruned by default), one target forward verifying
the tree with tree attention, and the longest path that matches the target's own tokens committed with its bonus
token. At temperature 0 the output equals the target's greedy output (:meth:`SpeculativeDecoder.generate_ar` gives
that baseline to compare with); above 0 it is distributed as the target's samples. The stats say how many tokens
each target forward committed (the acceptance length tau) and how fast it went. A list of prompts is decoded together
(:meth:`SpeculativeDecoder.generate_batch`, :mod:`dartree.decode.batched`), each answer equal to its own.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from dartree.base.dtypes import DTYPES
from dartree.base.fields import is_int, is_real
from dartree.decode.assembly import CALIBRATION_PROMPT, Assembly, assemble
from dartree.decode.batch_budget import BatchCostModel
from dartree.decode.batched import batched_generate, check_batched
from dartree.decode.budget import calibrate
from dartree.decode.row_costs import RowCosts, batch_rows
from dartree.decode.generate import (POLICY_PROMPT, DecodeStats, autoregressive_generate, check_speculative,
                                     seed_policy, speculative_generate, warm_paths)
from dartree.decode.inputs import check_lookup, check_speculative_args, token_ids
from dartree.decode.settings import DecodeSettings
from dartree.decode.builders import BUILDERS, builder_name
from dartree.models.chat import chat_prompt_ids, messages_prompt_ids, text_prompt_ids
from dartree.models.generation import sampling_problem, sampling_settings, stop_ids
from dartree.models.target import DEFAULT_TARGET, Target

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DRAFTER = REPO / "checkpoints" / "dspark_b16"  # the packaged DSpark drafter for the default target
PROMPT_FORMS = ("text (a str), chat messages (a list of {'role': ..., 'content': ...} dicts) or token ids (a list "
                "of ints)")


def _check_decode_args(max_new_tokens, temperature, seed) -> None:
    """The checks of :meth:`SpeculativeDecoder.generate` / ``generate_ar`` that need nothing loaded, run before any
    other work (a set-up or warm-up included). Raises: TypeError / ValueError naming the argument and value."""
    if not is_int(max_new_tokens):
        raise TypeError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0 (tokens to generate)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0 (tokens to generate)")
    if not is_real(temperature):
        raise TypeError(f"temperature={temperature!r} must be a number >= 0: 0 for greedy, e.g. 0.7 to sample")
    if not math.isfinite(float(temperature)) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be a finite number >= 0: 0 for greedy, e.g. 0.7 to sample")
    if not is_int(seed):
        raise TypeError(f"seed={seed!r} must be an integer (it seeds sampling at temperature > 0)")


@dataclass
class Generation:
    """One generated answer.

    Attributes:
        text: the generated tokens decoded as users' tools decode an answer (``skip_special_tokens=True``: no
            end-of-turn token such as ``<|im_end|>``); :attr:`raw_text` keeps them.
        tokens: generated token ids (prompt excluded; ends at the first of the target's end ids, inclusive).
        prompt_ids: the prompt's token ids as fed to the target (after the chat template).
        stats: :class:`~dartree.decode.generate.DecodeStats` (``tau``, ``accept_lengths``, ``rounds``, per-stage
            seconds, ``prefill_s``, ``decode_s``).
        seconds: wall time of the generation (prefill and decode).
        raw_text: the same tokens decoded with special tokens kept.
        setup_s: wall time of a one-time setup the call ran first, outside ``seconds`` (0.0 when none): warming the
            paths of a tree / budget / lookup setting not used before and, for ``budget="auto"``, calibrating and
            seeding its policy (:meth:`SpeculativeDecoder.warm_up`).
    """

    text: str
    tokens: list[int]
    prompt_ids: list[int]
    stats: DecodeStats
    seconds: float
    raw_text: str = ""
    setup_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time (``len(tokens) / seconds``)."""
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")


class BatchedDecoding:
    """The batched half of :class:`SpeculativeDecoder`'s API: several prompts decoded together
    (:meth:`generate_batch`; :meth:`SpeculativeDecoder.generate` comes here for a list of prompts). It uses the
    decoder's ``target``, ``draft``, ``stop_ids``, prompt handling, checks and :meth:`SpeculativeDecoder.warm_up`.
    Its ``budget="auto"`` policies (``batch_models``: {(tree, lookup, builder parameters): a
    :class:`~dartree.decode.batch_budget.BatchCostModel`}) start from the setting's seeded batch-1 policy and share
    one row table (``row_costs``: the cost ratios of forwards over N rows, measured once per row count).
    """

    def batch_model(self, key: tuple, rows: int) -> tuple[BatchCostModel, float]:
        """The ``budget="auto"`` policy of the setting ``key`` for batches of ``rows`` rows: the row counts such a
        batch runs at measured into the decoder's row table if not measured before
        (:meth:`~dartree.decode.row_costs.RowCosts.measure` on :data:`~dartree.decode.generate.POLICY_PROMPT`, keyed by
        row count), and the setting's batch policy made from its seeded batch-1 policy the first time (call
        :meth:`SpeculativeDecoder.warm_up` for the setting first). Returns (the policy, seconds spent: 0.0 when both
        were there).

        Raises:
            KeyError: the setting has no seeded batch-1 policy (:meth:`SpeculativeDecoder.warm_up` not run for it).
        """
        t0, spent = time.perf_counter(), False
        if self.row_costs.missing(batch_rows(rows)):
            ids = self.prompt_ids(POLICY_PROMPT) if self.target.tokenizer is not None else list(range(2, 34))
            self.row_costs.measure(self.target, self.draft.drafter, ids, batch_rows(rows),
                                   max_budget=self.draft.drafter.cfg.num_proposals)
            spent = True
        if key not in self.batch_models:
            self.batch_models[key] = BatchCostModel.from_model(self.cost_models[key], self.row_costs)
            spent = True
        return self.batch_models[key], (time.perf_counter() - t0 if spent else 0.0)

    def generate_batch(self, prompts: Sequence, *, max_new_tokens: int | Sequence[int] = 256, tree: str = "pruned",
                       budget: int | str | None = None, temperature: float = 0.0, seed: int = 0, lookup: int = 0,
                       chat: bool = True, ignore_generation_config: bool = False, batch_size: int | None = None,
                       **builder_params) -> list[Generation]:
        """Generate answers to several prompts decoded together (:func:`~dartree.decode.batched.batched_generate`):
        one drafter forward and one target verify forward per round for all rows, each row its own tree; each answer
        equals what :meth:`generate` gives for its prompt alone at temperature 0 (distributed as the target's samples
        above 0).

        Args:
            prompts: a list of prompts, each text, chat messages or token ids (:meth:`prompt_ids`).
            max_new_tokens: one cap for all, or one per prompt.
            budget: tree nodes per row and round (an int), ``"auto"`` (per round a cost model timed by rows as well
                as nodes per row decides whether the batch drafts and how wide every row's tree is, for the batch's
                throughput; :mod:`dartree.decode.batch_budget`), or None (default): ``"auto"`` at temperature 0, the
                drafter's proposals P above 0, as :meth:`generate`.
            batch_size: rows decoded together (default: all); with fewer, a finished row's place goes to the next
                prompt.
            tree, temperature, seed, lookup, chat, ignore_generation_config, builder_params: as :meth:`generate`.
        Returns:
            One :class:`Generation` per prompt, in order (``seconds``: its prefill and its time in the batch;
            ``setup_s``: the call's one-time setup, :meth:`warm_up`).
        Raises:
            TypeError / ValueError: as :meth:`generate`, a prompt named by its index, caps that are not one per
                prompt, a ``batch_size`` below 1; all before any set-up.
        """
        if isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Sequence) or not len(prompts):
            raise TypeError(f"prompts={prompts!r:.60} is not a list of prompts; give a list, each {PROMPT_FORMS}")
        caps = [max_new_tokens] * len(prompts) if not isinstance(max_new_tokens, Sequence) else list(max_new_tokens)
        for cap in caps:
            _check_decode_args(cap, temperature, seed)
        self._check_setting(tree, budget, lookup, builder_params)
        self._check_sampling(temperature, ignore_generation_config)
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(self.prompt_ids(p, chat=chat))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
        gen = torch.Generator(device=self.target.device.type).manual_seed(seed) if temperature > 0 else None
        dm = self.draft
        budget = ("auto" if temperature == 0 else None) if budget is None else budget
        settings = self.settings(tree=tree, budget=budget, lookup=lookup, max_new_tokens=max_new_tokens,
                                 temperature=temperature, **builder_params)
        rows = check_batched(self.target, dm.drafter, dm.head, ids, settings, generator=gen, batch_size=batch_size)[-1]
        setup = self.warm_up(tree=tree, budget=budget, lookup=lookup, **builder_params)
        policy = None
        if budget == "auto":
            policy, spent = self.batch_model(self._key(tree, lookup, builder_params), rows)
            setup += spent
        out = batched_generate(self.target, dm.drafter, dm.head, ids, settings, generator=gen, batch_size=batch_size,
                               cost_model=policy)
        res = []
        for o, pid in zip(out, ids):
            g = self._finish(o, pid, time.perf_counter())
            g.seconds, g.setup_s = o.stats.prefill_s + o.stats.decode_s, setup
            res.append(g)
        return res


class SpeculativeDecoder(BatchedDecoding):
    """A target and a drafter (backbone + correction head) loaded once, generating one request at a time or a list of
    them together (:meth:`generate_batch`).

    Build it with :func:`load`, or from an :class:`~dartree.decode.assembly.Assembly` of your own
    (:func:`~dartree.decode.assembly.assemble`, the one place target and drafter are built for decoding). Attributes:
    ``assembly`` (that object), and from it ``target`` (:class:`~dartree.models.target.Target`), ``draft``
    (:class:`~dartree.models.checkpoint.DraftModel`), ``linear`` (the linear-layer backend, ``onednn`` or ``aten``),
    ``invariant`` (the entered :class:`~dartree.models.invariant.row_invariant` mode or None) and ``invariant_note``
    (why), ``dtype`` (the models' torch dtype) and ``dtype_note`` (why: with ``load(dtype="auto")`` the figures it was
    chosen by); ``stop_ids`` (the target's end ids: where its own ``generate`` stops), ``modes`` (the
    ``contextlib.ExitStack`` holding the mode: ``decoder.modes.close()`` returns the target to its default kernels),
    ``cost_models`` ({(tree, lookup, builder parameters): the seeded ``budget="auto"`` policy}, kept across calls, so
    what one call learns the next one starts from; :meth:`warm_up` fills it).

    Args:
        models: the assembled target and drafter (its ``draft`` not None); the decoder takes over its ``modes``.
        chat_template_kwargs: extra chat-template variables (e.g. ``{"enable_thinking": False}`` for Qwen3).
    Raises:
        ValueError: an assembly without a drafter.
    """

    def __init__(self, models: Assembly, *, chat_template_kwargs: dict | None = None):
        if models.draft is None:
            raise ValueError("SpeculativeDecoder needs an assembly with a drafter (assemble(drafter=...))")
        self.assembly = models
        self.target, self.draft, self.linear = models.target, models.draft, models.linear
        self.dtype, self.dtype_note = models.dtype, models.dtype_note
        self.invariant, self.invariant_note = models.invariant, models.invariant_note
        self.modes = contextlib.ExitStack()
        self.modes.enter_context(models.modes)
        if self.invariant is not None:  # closing decoder.modes restores the kernels, and says so here
            self.modes.callback(setattr, self, "invariant_note", "row-invariant verify: off (decoder.modes closed)")
            self.modes.callback(setattr, self, "invariant", None)
        self.stop_ids = stop_ids(self.target)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.cost_models: dict = {}  # (tree, lookup, builder params) -> its budget="auto" policy, kept across calls
        self._timing = None  # the start-up calibration the policies copy (dartree.decode.budget.calibrate)
        self.row_costs = RowCosts()  # cost ratios of N-row forwards, measured once per row count (batches)
        self.batch_models: dict = {}  # (tree, lookup, builder params) -> its batched budget="auto" policy
        self._warmed: set = set()  # the settings warm_up prepared

    def prompt_ids(self, prompt: str | Sequence[dict] | Sequence[int], *, chat: bool = True) -> list[int]:
        """The token ids a prompt is fed to the target as.

        Args:
            prompt: text (one user turn), a chat as a list of ``{"role", "content"}`` messages, or token ids
                (taken as they are).
            chat: render text through the tokenizer's chat template with the generation prompt added (default);
                False feeds the raw text (a base model without a template).
        Raises:
            TypeError: a prompt of none of these forms (named; token ids as :func:`~dartree.decode.inputs.token_ids`
                takes them: a list, or a [T] / [1, T] integer tensor or array).
            ValueError: an empty prompt, a message without ``"role"`` and ``"content"``, text or messages with no
                tokenizer, messages with ``chat=False``, or a chat template that is missing or cannot take the
                ``chat_template_kwargs`` given to :func:`load`.
        """
        if not isinstance(prompt, str):
            messages = self._messages_or_ids(prompt)
            if not isinstance(messages[0], dict):
                return messages
            prompt = messages
        tok = self.target.tokenizer
        if tok is None:
            raise ValueError("the target has no tokenizer; pass the prompt as token ids")
        if not chat:
            if not isinstance(prompt, str):
                raise ValueError("chat messages need the chat template; pass chat=True or the text itself")
            return text_prompt_ids(tok, prompt)
        if isinstance(prompt, str):
            return chat_prompt_ids(tok, prompt, self.chat_template_kwargs)
        return messages_prompt_ids(tok, list(prompt), self.chat_template_kwargs)

    @staticmethod
    def _messages_or_ids(prompt) -> list:
        """A prompt that is not text, as a list: token ids as ints, or chat messages each with "role" and "content"
        (the Raises of :meth:`prompt_ids`)."""
        if hasattr(prompt, "shape") and hasattr(prompt, "dtype"):  # a tensor or array of ids
            return token_ids(prompt, "prompt")
        if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
            raise TypeError(f"prompt={prompt!r:.60} ({type(prompt).__name__}) is not a prompt; give {PROMPT_FORMS}")
        items = list(prompt)
        if not items:
            raise ValueError(f"prompt is an empty {type(prompt).__name__}; give {PROMPT_FORMS}")
        if isinstance(items[0], (list, tuple)):  # a batch of one, as [[ids]] (more rows are refused, named)
            return token_ids(items, "prompt")
        ids = is_int(items[0])  # the first item says which form was meant: token ids or chat messages
        for i, m in enumerate(items):
            if not (is_int(m) if ids else isinstance(m, dict)):
                what = ("not a token id, as prompt[0] is" if ids else "not a chat message, as prompt[0] is") if i \
                    else "neither a token id nor a chat message"
                raise TypeError(f"prompt[{i}]={m!r:.60} ({type(m).__name__}) is {what}; give {PROMPT_FORMS}")
            if not ids and ("role" not in m or "content" not in m):
                raise ValueError(f"prompt[{i}]={m!r:.60} is not a chat message: chat messages need \"role\" and "
                                 "\"content\" keys, e.g. {'role': 'user', 'content': 'Hello'}")
        return [int(t) for t in items] if ids else items

    def _check_setting(self, tree, budget, lookup, builder_params: dict) -> None:
        """The checks of a decode setting (tree, budget, lookup, builder parameters), before any work: an unknown tree
        named with the builders and their aliases (:func:`~dartree.decode.builders.builder_name`). Raises: TypeError /
        ValueError naming the argument and value."""
        if not isinstance(tree, str):
            raise TypeError(f"tree={tree!r:.60} ({type(tree).__name__}) is not a builder name; give one of "
                            f"{sorted(BUILDERS)}")
        check_lookup(lookup)
        check_speculative_args(self.target, self.draft.drafter, self.draft.head, builder=tree, budget=budget,
                               builder_params=builder_params or None)

    def _check_sampling(self, temperature: float, ignore_generation_config: bool) -> None:
        why = sampling_problem(sampling_settings(self.target), temperature, ignore_generation_config,
                               ignore_hint="ignore_generation_config=True", zero_hint="temperature=0")
        if why is not None:
            raise ValueError(why)

    def _finish(self, out, prompt_ids: list[int], t0: float) -> Generation:
        tok = self.target.tokenizer
        text = tok.decode(out.tokens, skip_special_tokens=True) if tok is not None else ""
        raw = tok.decode(out.tokens) if tok is not None else ""
        return Generation(text, list(out.tokens), prompt_ids, out.stats, time.perf_counter() - t0, raw_text=raw)

    def generate(self, prompt: str | Sequence[dict] | Sequence[int], *, max_new_tokens: int = 256,
                 tree: str = "pruned", budget: int | str | None = None, temperature: float = 0.0, seed: int = 0,
                 lookup: int = 0, chat: bool = True, ignore_generation_config: bool = False,
                 **builder_params) -> Generation:
        """Generate an answer with speculative decoding (:func:`~dartree.decode.generate.speculative_generate`).

        Args:
            prompt: text, chat messages or token ids (:meth:`prompt_ids`). A list of several prompts (texts, chats
                or id lists; :func:`is_prompt_list`) decodes them together instead: :meth:`generate_batch`, which
                returns a list. max_new_tokens: cap on generated tokens.
            tree: the tree builder: ``pruned`` (DARTree-pruned, default), ``chain``, ``ddtree``, ``pctree``,
                ``fixed`` (DARTree-fixed), ``heap-sequential`` (:data:`dartree.decode.builders.BUILDERS`; the aliases
                ``dartree-pruned`` / ``dartree-fixed`` work too).
            budget: tree nodes verified per round B: an int, ``"auto"`` (a cost model measured on this machine picks
                B per round, 0 meaning a plain AR step; :mod:`dartree.decode.budget`), or None (default):
                ``"auto"`` at temperature 0, the drafter's proposals P above 0 (``"auto"``'s choices follow measured
                times, so there a seed would fix the output's distribution but not the output).
            temperature: 0 for greedy (output equal to the target's), > 0 to sample (``seed`` seeds it).
            lookup: > 0 grafts a prompt-lookup chain of up to this many tokens onto each round's tree.
            chat: feed text through the chat template (default) or raw.
            ignore_generation_config: sample without the target's generation-config sampling settings (top_k,
                top_p, ...), which the decoders do not apply; without it such a target is refused at T > 0.
            builder_params: the builder's parameters (``k`` candidates, ``width`` W, ``beta`` depth bonus).
        Returns:
            :class:`Generation` (a list of them for a list of prompts). A setting (tree, budget kind, lookup, builder
            parameters) used for the first time
            is prepared by :meth:`warm_up` before the timing starts; its time is ``setup_s``, not in ``seconds``.
        Raises:
            TypeError: an argument of the wrong type, or a prompt of none of the forms above, named.
            ValueError: a bad value (an unknown tree builder, listed with the builders and aliases; a negative
                ``max_new_tokens`` or ``lookup``; a chat message without "role" and "content"), named (the checks of
                :func:`~dartree.decode.generate.speculative_generate` and :meth:`prompt_ids`), or sampling settings
                as above; all before any set-up.
        """
        if is_prompt_list(prompt):
            return self.generate_batch(prompt, max_new_tokens=max_new_tokens, tree=tree, budget=budget,
                                       temperature=temperature, seed=seed, lookup=lookup, chat=chat,
                                       ignore_generation_config=ignore_generation_config, **builder_params)
        _check_decode_args(max_new_tokens, temperature, seed)
        self._check_setting(tree, budget, lookup, builder_params)
        self._check_sampling(temperature, ignore_generation_config)
        ids = self.prompt_ids(prompt, chat=chat)
        budget = ("auto" if temperature == 0 else None) if budget is None else budget
        settings = self.settings(tree=tree, budget=budget, lookup=lookup, max_new_tokens=max_new_tokens,
                                 temperature=temperature, **builder_params)
        check_speculative(self.target, self.draft.drafter, self.draft.head, ids, settings)
        setup = self.warm_up(tree=tree, budget=budget, lookup=lookup, **builder_params)
        gen = torch.Generator(device=self.target.device.type).manual_seed(seed) if temperature > 0 else None
        policy = self.cost_models.get(self._key(tree, lookup, builder_params)) if budget == "auto" else None
        t0 = time.perf_counter()
        out = speculative_generate(self.target, self.draft.drafter, self.draft.head, ids, settings, generator=gen,
                                   cost_model=policy)
        g = self._finish(out, ids, t0)
        g.setup_s = setup
        return g

    def settings(self, *, tree: str = "pruned", budget: int | str | None = "auto", lookup: int = 0,
                 max_new_tokens: int | Sequence[int] = 256, temperature: float = 0.0,
                 **builder_params) -> DecodeSettings:
        """The :class:`~dartree.decode.settings.DecodeSettings` a call with these arguments decodes with (the
        target's stop ids, exact matching, the lookup graft's n-gram 3), for the decode functions of
        :mod:`dartree.decode` (``speculative_generate``, ``batched_generate``, ``decode_one``). Arguments as
        :meth:`generate`; checked where a decoder receives them."""
        return DecodeSettings(tree, budget, builder_params or None, "match", lookup, 3, max_new_tokens, temperature,
                              tuple(self.stop_ids))

    @staticmethod
    def _key(tree: str, lookup: int, builder_params: dict) -> tuple:
        """The policy's key of a setting: (builder's registered name, lookup, builder parameters)."""
        return builder_name(tree), int(lookup), tuple(sorted(builder_params.items()))

    def warm_up(self, *, tree: str = "pruned", budget: int | str | None = "auto", lookup: int = 0,
                **builder_params) -> float:
        """Prepare a decode setting before a timed call, so that no one-time cost and no unseeded policy is timed:
        every code path it takes runs at every size it can take (:func:`~dartree.decode.generate.warm_paths`, a
        short decode included), and for ``budget="auto"`` the machine's costs are calibrated (once per decoder,
        :func:`~dartree.decode.budget.calibrate`) and this setting's policy is seeded by a calibration pass of its
        own builder on :data:`~dartree.decode.generate.POLICY_PROMPT` (:func:`~dartree.decode.generate.seed_policy`).
        :func:`load` runs it for the defaults (and the AR path); :meth:`generate` for a setting it has not seen.

        Args:
            tree, budget, lookup, builder_params: the setting, as :meth:`generate` takes them (an int budget, None
                for P, or ``"auto"``).
        Returns:
            Seconds spent (0.0 when the setting was prepared already).
        Raises:
            TypeError / ValueError: an unknown builder (listed with the aliases) or a bad budget, lookup or builder
                parameter, named (as :meth:`generate`), before any work.
        """
        self._check_setting(tree, budget, lookup, builder_params)
        key = self._key(tree, lookup, builder_params)
        if (*key, budget) in self._warmed:
            return 0.0
        t0 = time.perf_counter()
        target, dm = self.target, self.draft
        settings = self.settings(tree=tree, budget=budget, lookup=lookup, **builder_params)
        ids = self.prompt_ids(POLICY_PROMPT) if target.tokenizer is not None else list(range(2, 34))
        warm_paths(target, dm.drafter, dm.head, ids, [settings])
        if budget == "auto":
            if self._timing is None:
                self._timing = calibrate(target, dm.drafter, ids, max_budget=dm.drafter.cfg.num_proposals)
            self.cost_models[key] = self._timing.fresh()
            seed_policy(self.cost_models[key], target, dm.drafter, dm.head, ids, settings)
        self._warmed.add((*key, budget))
        return time.perf_counter() - t0

    def generate_ar(self, prompt: str | Sequence[dict] | Sequence[int], *, max_new_tokens: int = 256,
                    temperature: float = 0.0, seed: int = 0, chat: bool = True,
                    ignore_generation_config: bool = False) -> Generation:
        """The target alone, one token per forward (:func:`~dartree.decode.generate.autoregressive_generate`): the
        baseline :meth:`generate` equals at temperature 0 and is timed against. Arguments and errors as
        :meth:`generate` (TypeError / ValueError naming a bad argument, before any work)."""
        _check_decode_args(max_new_tokens, temperature, seed)
        self._check_sampling(temperature, ignore_generation_config)
        ids = self.prompt_ids(prompt, chat=chat)
        gen = torch.Generator(device=self.target.device.type).manual_seed(seed) if temperature > 0 else None
        t0 = time.perf_counter()
        out = autoregressive_generate(self.target, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                      stop_ids=self.stop_ids, generator=gen)
        return self._finish(out, ids, t0)


def is_prompt_list(prompt) -> bool:
    """Whether :meth:`SpeculativeDecoder.generate` reads ``prompt`` as several prompts: a list or tuple of texts, of
    chats (lists of message dicts), or of two or more token-id lists. One prompt stays one: text, one chat (a list of
    dicts), token ids, and a single id list inside a list (``[[ids]]``, the [1, T] form of ``input_ids``)."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    first = prompt[0]
    if isinstance(first, str):
        return True
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], dict):
        return True
    rows = isinstance(first, (list, tuple)) or (hasattr(first, "shape") and getattr(first, "ndim", 0) >= 1)
    return rows and len(prompt) > 1


def load(drafter: str | os.PathLike = DEFAULT_DRAFTER, target: str | os.PathLike = DEFAULT_TARGET, *,
         dtype: str = "auto", linear: str = "auto", threads: int | None = None,
         chat_template_kwargs: dict | None = None, invariant: str = "auto", warm_up: bool = True
         ) -> SpeculativeDecoder:
    """Load a target and a dartree drafter checkpoint for speculative decoding.

    The models are built by :func:`dartree.decode.assembly.assemble` (the one assembly every program uses; these
    are its defaults), with no linear tuning, and the dtype candidates timed on :data:`CALIBRATION_PROMPT` through
    the chat template with ``chat_template_kwargs``.

    Args:
        drafter: a dartree checkpoint folder (default: the packaged ``checkpoints/dspark_b16``); a published one
            converts with ``python convert/to_dartree.py``, and ``training/train.py`` writes this format.
        target: ``smollm2`` (the packaged SmolLM2-135M-Instruct, default), ``tiny-qwen3`` or a local Hugging Face
            model folder.
        dtype: ``auto`` (default), ``float32``, ``bfloat16`` or ``float16`` for both models. ``auto``: float32
            where the CPU has no native bf16; where it has, bfloat16 (in the row-invariant mode, so still exact) and
            float32 are both loaded and timed on :data:`CALIBRATION_PROMPT` (an AR step, verifies, a draft;
            :func:`dartree.decode.precision.pick_dtype`) and the faster is kept (a second load and the timing: 10-15 s
            on a quiet 2-core machine, several times that on a busy one).
            ``decoder.dtype_note`` says which and why.
        linear: linear-layer backend: ``auto`` (prepacked oneDNN where the CPU supports it, else ``F.linear``),
            ``onednn`` or ``aten``.
        threads: torch CPU threads (None keeps torch's setting).
        chat_template_kwargs: extra chat-template variables (e.g. ``{"enable_thinking": False}`` for Qwen3).
        invariant: the row-invariant mode (:func:`dartree.models.invariant.enter_invariant`): ``auto`` (default:
            on for a CPU target in bfloat16, off in float32), ``on`` or ``off``. With it a
            verify row computes the AR step's bits, so at T = 0 ``generate`` equals ``generate_ar`` by
            construction; ``decoder.invariant_note`` says which was chosen and why.
        warm_up: prepare the default setting before returning (:meth:`SpeculativeDecoder.warm_up`: every path of
            DARTree-pruned with ``budget="auto"`` run at every size, the machine's costs calibrated and the policy
            seeded by a calibration pass; plus a short AR decode), so that the first ``generate`` and
            ``generate_ar`` are timed warm (a few seconds more at load). False leaves it to the first call, which
            reports it as ``setup_s``.
    Returns:
        :class:`SpeculativeDecoder`.
    Raises:
        TypeError: ``threads`` not an integer, or ``dtype`` not a name (named).
        ValueError: ``threads`` < 1, an unknown dtype (named with ``auto`` and the dtypes), linear backend or
            invariant choice, ``invariant="on"`` where the mode has no path here (the reason;
            :class:`~dartree.decode.assembly.ModeUnavailable`), or a target that cannot be loaded (its reason;
            :class:`~dartree.decode.assembly.TargetLoadError`).
        dartree.models.checkpoint.CheckpointError: the drafter folder is not a dartree checkpoint or does not
            fit the target (named).
    """
    _check_load_args(threads, dtype)
    if threads is not None:
        torch.set_num_threads(int(threads))
    kwargs = dict(chat_template_kwargs or {})

    def calibration_ids(tgt: Target) -> list[int]:  # the prompt as generate feeds it, template options included
        return chat_prompt_ids(tgt.tokenizer, CALIBRATION_PROMPT, kwargs) if tgt.tokenizer is not None \
            else list(range(2, 34))

    models = assemble(drafter, target, dtype=dtype, linear=linear, invariant=invariant,
                      calibration_ids=calibration_ids)
    decoder = SpeculativeDecoder(models, chat_template_kwargs=kwargs)
    if warm_up:  # the first timed generate / generate_ar of the user's then pay no one-time cost
        decoder.warm_up()
        ids = decoder.prompt_ids(POLICY_PROMPT) if models.target.tokenizer is not None else list(range(2, 34))
        decoder.generate_ar(ids, max_new_tokens=8)
    return decoder


def _check_load_args(threads, dtype) -> None:
    """The checks of :func:`load` that need nothing loaded. Raises: TypeError / ValueError naming the argument."""
    if threads is not None and not is_int(threads):
        raise TypeError(f"threads={threads!r} must be a positive integer (torch CPU threads) or None (torch's setting)")
    if threads is not None and threads < 1:
        raise ValueError(f"threads={threads} must be >= 1 (torch CPU threads) or None (torch's setting)")
    names = ", ".join(["auto", *sorted(DTYPES)])
    if not isinstance(dtype, str):
        raise TypeError(f"dtype={dtype!r} ({type(dtype).__name__}) is not a dtype name; use dtype= one of {names}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} in load(dtype={dtype!r}); use dtype= one of {names}")
