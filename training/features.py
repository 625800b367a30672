"""The target's features (stage 3 of :mod:`dartree.training.data`'s pipeline): one target forward per sequence
storing the captured layer outputs [T, nL*D] and the final (normed) hidden state [T, D] in bf16, from which training
recomputes the target distribution p_t (:func:`compute_features`), and the target's log-sum-exp at every position for a
draft vocabulary (:func:`target_lse`). Dimension letters as in :mod:`dartree.models.target`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from dartree.base.files import write_file_atomically
from dartree.base.integrity import cached, file_record, write_record
from dartree.models.target import Target
from dartree.training.answers import key_hash, load_responses

FEATURE_SAVE_EVERY_S = 30.0  # compute_features: flush and record progress this often (a kill loses at most this)
_ST_DTYPES = {torch.bfloat16: ("BF16", np.uint16), torch.int64: ("I64", np.int64), torch.float32: ("F32", np.float32)}


def _safetensors_memmap(path: Path, specs: dict, metadata: dict, *, create: bool) -> dict:
    """Writable memory-mapped tensors inside a safetensors file, so a file larger than memory is filled in place.

    Args:
        path: the file. specs: name -> (torch dtype in bf16 / int64 / fp32, shape), laid out in this order.
        metadata: the header's ``__metadata__`` (str -> str).
        create: True writes the header and sizes the file (zero-filled); False maps an existing file that was
            created with the same specs (a resumed run).
    Returns:
        name -> tensor sharing memory with the file (write into it; ``flush`` via the ``"_maps"`` entry's memmaps).
    Raises:
        ValueError: ``create=False`` and the file's header differs from ``specs`` (size, names or shapes).
    """
    header, off = {}, 0
    for name, (dtype, shape) in specs.items():
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype][0], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    start = 8 + len(raw)
    if create:
        with open(path, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little"))
            fh.write(raw)
            fh.truncate(start + off)
    else:
        with open(path, "rb") as fh:
            have = fh.read(start)
        if have != len(raw).to_bytes(8, "little") + raw or path.stat().st_size != start + off:
            raise ValueError(f"{path} does not hold the expected tensors; delete it to start over")
    out, maps = {}, []
    for name, (dtype, shape) in specs.items():
        a, _ = header[name]["data_offsets"]
        mm = np.memmap(path, dtype=_ST_DTYPES[dtype][1], mode="r+", offset=start + a, shape=tuple(shape))
        maps.append(mm)
        out[name] = torch.from_numpy(mm).view(dtype)
    out["_maps"] = maps
    return out


def _feature_batches(seqs: Sequence[Sequence[int]], max_tokens_per_batch: int) -> list[list[int]]:
    """Sequence indices grouped into target forwards, shortest first: a batch grows while its rows times its
    longest sequence stays within ``max_tokens_per_batch`` padded tokens (a longer sequence is a batch alone)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i]) > max_tokens_per_batch:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _open_feature_file(tmp: Path, progress: Path, specs: dict, meta: dict, offsets: list[int]) -> tuple[dict, int]:
    """The memory-mapped feature file being filled (:func:`_safetensors_memmap`) and the number of batches already
    in it: an earlier run's ``tmp`` with its ``progress`` record when both are intact, else a fresh file (0)."""
    if tmp.exists() and progress.exists():
        try:
            mapped = _safetensors_memmap(tmp, specs, meta, create=False)
            done = int(json.loads(progress.read_text())["batches"])
            if done:
                return mapped, done
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):  # a record cut short: start afresh
            pass
    progress.unlink(missing_ok=True)
    mapped = _safetensors_memmap(tmp, specs, meta, create=True)
    mapped["offsets"].copy_(torch.tensor(offsets, dtype=torch.long))
    return mapped, 0


def _forward_batch(target: Target, seqs: Sequence[Sequence[int]], batch: list[int], captured: dict):
    """One right-padded target forward over the sequences ``batch``; returns its output (``features`` [B, T, nL*D])
    and leaves the final-norm output [B, T, D] in ``captured["final"]`` (a forward hook)."""
    width = max(len(seqs[i]) for i in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, i in enumerate(batch):
        ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
        mask[r, : len(seqs[i])] = 1
    return target.forward(ids.to(target.device), attention_mask=mask.to(target.device), logits_slice=slice(0, 0))


def compute_features(target: Target, responses: Path, *, max_tokens_per_batch: int = 4096) -> Path:
    """Run the target once over every (prompt + response) and cache its features; return the file path.

    The file ``features-<hash>.safetensors`` beside ``responses.jsonl`` holds ``feats`` [T_all, nL*D] bf16,
    ``final`` [T_all, D] bf16 (the final-normed hidden, so p_t = softmax(lm_head(final))) and ``offsets``
    [n+1] int64 into the concatenated token axis. The hash covers the layer ids and the target.

    The file is filled in place through a memory map (:func:`_safetensors_memmap`; a feature file larger than
    memory is fine: 5.8 KB per token at 5 x 576) in ``features-<hash>.tmp``, batch by batch
    (:func:`_feature_batches`), with the number of finished batches in ``features-<hash>.progress`` (written every
    :data:`FEATURE_SAVE_EVERY_S` after a flush), so a killed run resumes at that batch
    (:func:`_open_feature_file`); the final name appears by atomic rename, then its size and sha256 are recorded
    beside it (:func:`dartree.base.integrity.write_record`) and checked before it is reused (a file that fails is
    computed again: hashing is about 2 s for 2.8 GB, the forwards hours).
    """
    key = {"target": target.name, "layers": target.layer_ids, "responses": str(responses), "v": 1,
           "rows": file_record(responses)["sha256"]}  # regenerated rows (a cache that failed its check) key anew
    out = responses.parent / f"features-{key_hash(key)}.safetensors"
    if cached(out):
        return out
    ds = load_responses(responses)
    seqs = [p + r for p, r in zip(ds["prompt_ids"], ds["response_ids"])]
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    nl = len(target.layer_ids)
    batches = _feature_batches(seqs, max_tokens_per_batch)
    tmp, progress = out.with_suffix(".tmp"), out.with_suffix(".progress")
    total = offsets[-1]
    specs = {"offsets": (torch.int64, (len(offsets),)), "feats": (torch.bfloat16, (total, nl * target.hidden_size)),
             "final": (torch.bfloat16, (total, target.hidden_size))}
    mapped, done = _open_feature_file(tmp, progress, specs, {"layer_ids": json.dumps(target.layer_ids),
                                                             "target": target.name}, offsets)
    feats, final = mapped["feats"], mapped["final"]

    def save_progress(n: int) -> None:
        for mm in mapped["_maps"]:
            mm.flush()
        progress.write_text(json.dumps({"batches": n, "of": len(batches)}))

    captured = {}
    hook = target.model.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("final", o))
    last = time.time()
    try:
        for b in tqdm(range(done, len(batches)), desc="target features", unit="batch", initial=done,
                      total=len(batches)):
            out_t = _forward_batch(target, seqs, batches[b], captured)
            for r, i in enumerate(batches[b]):
                n = len(seqs[i])
                feats[offsets[i] : offsets[i] + n] = out_t.features[r, :n].to(torch.bfloat16).cpu()
                final[offsets[i] : offsets[i] + n] = captured["final"][r, :n].to(torch.bfloat16).cpu()
            if time.time() - last > FEATURE_SAVE_EVERY_S:
                save_progress(b + 1)
                last = time.time()
    finally:
        hook.remove()
    save_progress(len(batches))
    del feats, final, mapped
    os.replace(tmp, out)
    write_record(out)
    progress.unlink(missing_ok=True)
    return out



@torch.no_grad()
def target_lse(target: Target, features: Path, *, chunk: int = 2048) -> torch.Tensor:
    """log-sum-exp over the full vocabulary of the target's logits at every cached position: [T_all] fp32.

    Computed once from the cached final hidden states (lm_head only, no target forward) and cached beside the
    features as ``lse-<features name>.safetensors`` (its size and sha256 recorded beside it and checked before
    reuse); with it, p_t on a draft vocabulary and the p_t mass outside it need only the draft vocabulary's lm_head
    rows during training.
    """
    out = features.with_name("lse-" + features.name)
    if cached(out):
        return load_file(str(out))["lse"]
    with safe_open(str(features), framework="pt") as fh:  # the final states only, not the (larger) layer features
        final = fh.get_tensor("final")
    w = target.lm_head.weight
    lse = torch.empty(final.shape[0], dtype=torch.float32)
    for a in tqdm(range(0, final.shape[0], chunk), desc="target log-sum-exp", unit="chunk"):
        z = torch.nn.functional.linear(final[a : a + chunk].to(w.device, w.dtype), w).float()
        lse[a : a + chunk] = torch.logsumexp(z, dim=-1).cpu()
    write_file_atomically(out, save({"lse": lse}))
    write_record(out)
    return lse
