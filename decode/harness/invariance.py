"""Which operations of the target's forward give a row different bits alone than inside a larger call.

``python decode/harness/invariance.py [--dtype float32 bfloat16] [--rows 9 17] [--linear aten onednn]`` prints, for the
default target on the CPU at hand, a map of row invariance: a verify forward computes the logits of its first row
(the root, whose context is exactly the committed prefix) in a call of M rows, the AR step computes the same row
in a call of one; speculative decoding is lossless by construction only where they are bit-equal (the
batch-invariance argument of He et al., "Defeating Nondeterminism in LLM Inference", Thinking Machines Lab, 2025).

Each operation is measured in isolation, on the very inputs the M-row verify forward gave it, so a difference
upstream never shows up as one downstream:

- every linear layer (q/k/v/o projections, the MLP, the lm_head) and every RMSNorm: ``op(x[:1])[0]`` against
  ``op(x[:M])[0]``;
- the attention core (the model's attention function after rotary embedding): the root's query over the prefix
  and itself (the AR step: no mask, P + 1 keys) against the M queries over the prefix and all M rows with the
  additive tree mask (P + M keys);
- end to end: the root's logits from a one-token forward against those of the M-token forward, both from the
  same key/value cache of the prefix.

A row reads ``equal`` where the bits agree, else the largest absolute difference. ``--cost`` prints instead what
the row-invariant mode costs per AR step and per verify against today's kernels (:func:`mode_cost`). Dimension
letters: P prefix tokens, M rows of the verify call, D hidden size.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from dartree.models.packed import choose_linear, pack_linears, tune_linears
from dartree.base.cli import fail
from dartree.models.invariant import choose_invariant_linear, row_invariant
from dartree.models import target as target_lib


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """0.0 where ``a`` and ``b`` are bit-equal, else their largest absolute difference (at least 1e-30)."""
    if torch.equal(a, b):
        return 0.0
    return max(float((a.float() - b.float()).abs().max()), 1e-30)


def _tree_mask(p: int, m: int, dtype: torch.dtype, tree: bool) -> torch.Tensor:
    """Additive [1, 1, M, P + M] mask: every row sees the prefix; a chain row sees the rows before it, a tree row
    (``tree``: rows 1..M-1 are siblings under row 0) sees row 0 and itself."""
    neg = torch.finfo(dtype).min
    mask = torch.full((m, p + m), neg, dtype=dtype)
    mask[:, :p] = 0
    for r in range(m):
        mask[r, p + r] = 0
        if tree:
            mask[r, p] = 0
        else:
            mask[r, p : p + r + 1] = 0
    return mask[None, None]


@torch.no_grad()
def verify_rows_vs_ar(target, prompt_ids: list[int], rows: int = 9, *, tree: bool = False) -> list[bool]:
    """End to end: does each row of one verify forward give the logits the AR step to the same node gives?

    From a key/value cache of the prefix, one forward of ``rows`` tokens (the root, then ``prompt_ids``' own tokens
    again: a chain, or with ``tree`` siblings under the root, under the additive tree mask) against one-token
    forwards that reach the same nodes (a chain: step after step; a tree: the root's step, then each sibling from a
    copy of the cache after it). Runs with whatever kernels ``target`` has now: call it inside
    :class:`~dartree.models.invariant.row_invariant` to check the mode, outside to see today's kernels.

    Args:
        target: a :class:`~dartree.models.target.Target` on any device. prompt_ids: the committed prefix and the
            root (>= 2 tokens; the rows reuse its first tokens, so >= rows tokens for distinct ones).
        rows: M, the verify call's rows (>= 2). tree: siblings under the root rather than a chain.
    Returns:
        [M] per row: its logits [V] bit-equal to the AR step's.
    Raises:
        ValueError: rows < 2 or a prompt of fewer than 2 tokens.
    """
    from transformers import DynamicCache

    if rows < 2 or len(prompt_ids) < 2:
        raise ValueError(f"verify_rows_vs_ar: rows ({rows}) and the prompt length ({len(prompt_ids)}) must be >= 2")
    m, dev = target.model, target.model.device
    prefix, root = list(prompt_ids[:-1]), prompt_ids[-1]
    extra = (list(prompt_ids) * rows)[: rows - 1]
    p = len(prefix)

    def t(x):
        return torch.tensor(x, device=dev)

    cache = DynamicCache(config=m.config)
    m(input_ids=t([prefix]), past_key_values=cache, use_cache=True)
    pos = [p] + ([p + 1] * (rows - 1) if tree else list(range(p + 1, p + rows)))
    verify = m(input_ids=t([[root] + extra]), position_ids=t([pos]),
               attention_mask=_tree_mask(p, rows, m.dtype, tree).to(dev), past_key_values=copy.deepcopy(cache),
               use_cache=True).logits[0]
    ar = copy.deepcopy(cache)
    equal = [torch.equal(m(input_ids=t([[root]]), position_ids=t([[p]]), past_key_values=ar,
                           use_cache=True).logits[0, 0], verify[0])]
    for r, tok in enumerate(extra, start=1):
        c = copy.deepcopy(ar) if tree else ar
        step = m(input_ids=t([[tok]]), position_ids=t([[pos[r]]]), past_key_values=c, use_cache=True).logits[0, 0]
        equal.append(torch.equal(step, verify[r]))
    return equal


@torch.no_grad()
def row_invariance_map(target, prompt_ids: list[int], rows: int, *, tree: bool = True) -> dict[str, float]:
    """Measure row invariance of every operation of ``target`` for a verify call of ``rows`` rows.

    Args:
        target: a :class:`~dartree.models.target.Target` (Llama-family decoder: q/k/v/o, gate/up/down, RMSNorm).
        prompt_ids: the committed prefix (P >= 2 tokens); its last token is the root.
        rows: M, the rows of the verify call (>= 2); rows 1..M-1 are the prompt's own tokens again (any tokens do).
        tree: the M rows form a tree (siblings under the root) rather than a chain.
    Returns:
        op name -> 0.0 (bit-equal) or the largest absolute difference of the root's output, for the linear ops
        (``layers.{i}.{name}``, ``lm_head``), norms, ``layers.{i}.attention`` and ``logits`` (end to end); for
        ops repeated over layers see :func:`summarise`.
    Raises:
        ValueError: rows < 2 or a prompt of fewer than 2 tokens.
    """
    from transformers import AttentionInterface, DynamicCache

    if rows < 2 or len(prompt_ids) < 2:
        raise ValueError(f"row_invariance_map: rows ({rows}) and the prompt length ({len(prompt_ids)}) must be >= 2")
    model = target.model
    prefix, root = prompt_ids[:-1], prompt_ids[-1]
    extra = (list(prompt_ids) * rows)[: rows - 1]
    p = len(prefix)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prefix]), past_key_values=cache, use_cache=True)
    inputs: dict[str, torch.Tensor] = {}
    attn_calls: list[tuple] = []
    hooks = []
    for name, mod in model.named_modules():
        kind = type(mod).__name__
        if isinstance(mod, torch.nn.Linear) or kind.endswith("RMSNorm"):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: inputs.__setitem__(n, a[0].detach())))
    impl = model.config._attn_implementation
    base_fn = AttentionInterface()[impl] if impl != "eager" else None

    def recording(module, query, key, value, attention_mask, **kw):
        attn_calls.append((query, key, value, attention_mask, kw.get("scaling"), kw.get("dropout", 0.0)))
        if base_fn is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward

            return eager_attention_forward(module, query, key, value, attention_mask, **kw)
        return base_fn(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("dartree_record", recording)
    model.set_attn_implementation("dartree_record")
    verify_cache = copy.deepcopy(cache)
    try:
        mask = _tree_mask(p, rows, target.dtype, tree)
        pos = [p] + [p + 1] * (rows - 1) if tree else list(range(p, p + rows))
        out_m = model(input_ids=torch.tensor([[root] + extra]), position_ids=torch.tensor([pos]),
                      attention_mask=mask, past_key_values=verify_cache, use_cache=True)
    finally:
        model.set_attn_implementation(impl)
        for h in hooks:
            h.remove()
    res: dict[str, float] = {}
    mods = dict(model.named_modules())
    for name, x in inputs.items():
        mod = mods[name]
        res[name.replace("model.", "", 1)] = _diff(mod(x[:, :1])[0, 0], mod(x)[0, 0])
    fn = base_fn
    for li, (q, k, v, am, scaling, _) in enumerate(attn_calls):
        kw = {"scaling": scaling, "dropout": 0.0}
        if fn is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as fn
        module = model.model.layers[li].self_attn
        one, _ = fn(module, q[:, :, :1], k[:, :, : p + 1], v[:, :, : p + 1], None, **kw)
        many, _ = fn(module, q, k, v, am, **kw)
        res[f"layers.{li}.attention"] = _diff(one[0, 0], many[0, 0])
    out_1 = model(input_ids=torch.tensor([[root]]), position_ids=torch.tensor([[p]]), past_key_values=cache,
                  use_cache=True)
    res["logits"] = _diff(out_1.logits[0, 0], out_m.logits[0, 0])
    return res


def summarise(res: dict[str, float]) -> list[tuple[str, int, int, float]]:
    """Group :func:`row_invariance_map` results by operation kind over the layers: rows of (op, layers measured,
    layers that differ, largest difference)."""
    groups: dict[str, list[float]] = {}
    for name, d in res.items():
        parts = name.split(".")
        key = ".".join(parts[2:]) if parts[0] == "layers" else name
        groups.setdefault(key, []).append(d)
    return [(k, len(v), sum(1 for d in v if d > 0), max(v)) for k, v in groups.items()]


@torch.no_grad()
def mode_cost(target_name: str, dtype: torch.dtype, prefix: int = 300, calls: int = 24,
              shapes: tuple = ((1, False), (9, False), (9, True), (17, True))) -> tuple[str, list[tuple]]:
    """What the row-invariant mode costs per target forward, against today's kernels, in one process.

    Two copies of the target (default kernels: oneDNN-packed and tuned linears, SDPA; and the mode), the same
    random prefix in each cache, and for each shape ``calls`` forwards alternating between the copies (A B, B A,
    ...) so that the machine's noise falls on both; the first 4 of each are warm-up.

    Args:
        target_name: ``smollm2`` or a local folder. dtype: float32 or bfloat16. prefix: cached tokens.
        shapes: (rows M, tree) pairs: M = 1 is an AR step, else a verify of M rows, a chain or a tree of siblings.
    Returns:
        (the mode's linear path and why, rows of (label, median ms today, median ms in the mode)).
    Raises:
        ValueError: no row-invariant path here (:func:`dartree.models.invariant.choose_invariant_linear`).
    """
    import statistics
    import time

    from transformers import DynamicCache

    today, inv = target_lib.load_target(target_name, dtype=dtype), target_lib.load_target(target_name, dtype=dtype)
    for t in (today, inv):
        pack_linears(t.model, "onednn")
        tune_linears(t.model)
    mode = row_invariant(inv)
    mode.__enter__()
    try:
        ids = torch.randint(100, min(40000, today.model.config.vocab_size), (1, prefix),
                            generator=torch.Generator().manual_seed(0))
        caches = []
        for t in (today, inv):
            caches.append(DynamicCache(config=t.model.config))
            t.model(input_ids=ids, past_key_values=caches[-1], use_cache=True)
        rows = []
        for m, tree in shapes:
            x = torch.randint(100, 1000, (1, m), generator=torch.Generator().manual_seed(m))
            kw = {} if m == 1 else {"position_ids": torch.tensor([[prefix] + [prefix + 1] * (m - 1) if tree else
                                                                  list(range(prefix, prefix + m))]),
                                    "attention_mask": _tree_mask(prefix, m, dtype, tree)}
            times: list[list[float]] = [[], []]
            for i in range(calls):
                for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                    cache, model = caches[j], (today, inv)[j].model
                    if cache.get_seq_length() > prefix:
                        cache.crop(prefix - cache.get_seq_length())
                    t0 = time.perf_counter()
                    model(input_ids=x, past_key_values=cache, use_cache=True, **kw)
                    times[j].append(time.perf_counter() - t0)
            label = "AR step" if m == 1 else f"{'tree' if tree else 'chain'} verify, {m} rows"
            rows.append((label, statistics.median(times[0][4:]) * 1e3, statistics.median(times[1][4:]) * 1e3))
        return f"{mode.linear}: {mode.why}", rows
    finally:
        mode.__exit__(None, None, None)


def _print_maps(args: argparse.Namespace) -> None:
    """The map for each dtype x linear backend x row count (``main`` without ``--cost``)."""
    for dname in args.dtype:
        dtype = getattr(torch, dname)
        target = target_lib.load_target(args.target, dtype=dtype)
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Explain how a hash map works, "
                                                    "with a short example in Python."}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        for backend in args.linear:
            invariant = backend in ("onednn-invariant", "row-invariant")
            try:
                chosen, why = choose_linear("onednn" if invariant else backend, dtype)
            except ValueError as exc:
                print(f"\n{dname}, linear {backend}: skipped ({exc})")
                continue
            min_rows, max_rows = 1, None
            if invariant and chosen == "onednn":  # the tiling the mode takes here, else the plain packed call
                try:
                    tiling = choose_invariant_linear(target.model)
                    if tiling.backend == "onednn":
                        min_rows, max_rows = tiling.min_rows, tiling.max_rows
                except ValueError:
                    pass
            pack_linears(target.model, chosen, row_invariant=invariant and chosen == "onednn", min_rows=min_rows,
                         max_rows=max_rows)
            pad = (f", one-row calls padded to {min_rows}" if min_rows > 1 else "") + (
                f", calls over {max_rows} rows split" if max_rows is not None else "")
            chosen += {"onednn-invariant": f" (every row count packed{pad})",
                       "row-invariant": f" (every row count packed{pad}) + row-invariant attention"}.get(backend, "")
            for m in args.rows:
                if backend == "row-invariant":
                    with row_invariant(target):
                        res = row_invariance_map(target, ids, m, tree=not args.chain)
                else:
                    res = row_invariance_map(target, ids, m, tree=not args.chain)
                print(f"\n{dname}, linear {chosen} ({why}), {'chain' if args.chain else 'tree'} of {m} rows, "
                      f"prefix {len(ids) - 1} tokens:")
                print(f"  {'operation':<28} {'layers':>6} {'differ':>6}  largest |diff|")
                for op, n, bad, mx in summarise(res):
                    print(f"  {op:<28} {n:>6} {bad:>6}  {'equal' if mx == 0 else f'{mx:.3g}'}")
            pack_linears(target.model, "aten")


def main(argv: list[str] | None = None) -> int:
    """Console entry point: print the map (or with ``--cost`` the mode's cost per forward) for each dtype; returns 0
    (2 when the mode has no path here, with the reason)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--rows", nargs="+", type=int, default=[9, 17])
    ap.add_argument("--linear", nargs="+", default=["aten", "onednn", "onednn-invariant", "row-invariant"],
                    choices=["aten", "onednn", "onednn-invariant", "row-invariant"],
                    help="onednn-invariant: the packed call for every row count (pack_linears(row_invariant=True)); "
                         "row-invariant: that and the row-invariant attention (dartree.models.invariant)")
    ap.add_argument("--chain", action="store_true", help="a chain of M rows instead of a tree of siblings")
    ap.add_argument("--cost", action="store_true",
                    help="instead of the map: ms per AR step and per 9- and 17-row verify with today's kernels and "
                         "in the row-invariant mode, two copies of the target, calls alternating (mode_cost)")
    ap.add_argument("--prefix", type=int, default=300, help="--cost: cached tokens before the measured forward")
    ap.add_argument("--target", default="smollm2")
    args = ap.parse_args(argv)
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    if not args.cost:
        _print_maps(args)
        return 0
    for dname in args.dtype:
        try:
            how, rows = mode_cost(args.target, getattr(torch, dname), prefix=args.prefix)
        except ValueError as exc:
            return fail(f"--cost {dname}: {exc}")
        print(f"\n{dname}, prefix {args.prefix} tokens; the mode's linears {how}")
        print(f"  {'forward':<24} {'today ms':>9} {'mode ms':>9} {'mode/today':>11}")
        for label, a, b in rows:
            print(f"  {label:<24} {a:>9.1f} {b:>9.1f} {b / a:>11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
