"""Training-side benchmark: regeneration tokens/s, training predictions/s and peak memory per recipe, and the
2-process DeepSpeed run. Prints a table and writes a JSON report (atomically).

    python training/tools/bench.py [--recipes dflash_b16 domino_b16 dspark_b16] [--steps 40] [--regen-prompts 256]
                             [--hf-baseline] [--two-process dspark_b16] [--out reports/bench.json]

Each training figure comes from a real ``training/train.py`` run of ``--steps`` optimiser steps in a fresh
process (its summary.json: predictions/s over the training steps, peak RSS); the first run of a recipe whose
data is not cached yet regenerates it first (minutes; cached after). Regeneration is timed on
``--regen-prompts`` ShareGPT prompts drawn with the first recipe's data settings (seed, prompt cap, code
share; with a code share they are not the data set's first prompts), with the continuous-batching generator the
data stage uses (``--hf-baseline`` adds ``transformers`` ``generate`` on the same prompts and batch size).
Figures depend on what else runs on the machine: run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dartree.base.cli import fail
from dartree.base.files import write_file_atomically
from dartree.base.records import NUMBER, RecordError, read_json
from dartree.models.generation import stop_ids
from dartree.training.settings import parse_recipe_dtype
from dartree.training.checks import template_kwargs
from dartree.training.dialogues import chat_prompts
from dartree.training.recipe import load_recipe
from dartree.training.regen import continuous_greedy
from dartree.models import target as target_lib

REPO = Path(__file__).resolve().parents[2]


def bench_regeneration(recipe: str, n: int, hf_baseline: bool) -> dict:
    """Response tokens/s of the data stage's generator (and optionally of ``generate``) on ``n`` prompts."""
    cfg = load_recipe([f"recipe={recipe}"])
    target = target_lib.load_target(cfg.target.path, dtype=parse_recipe_dtype(cfg.target.gen_dtype, "target.gen_dtype"))
    prompts = chat_prompts(target.tokenizer, n, cfg.data.seed, cfg.data.max_prompt_tokens, cfg.data.code_fraction,
                           template_kwargs(cfg))
    stops = stop_ids(target)  # every id at which the target's own generate stops, as the data stage
    t0, n_tok = time.perf_counter(), 0
    for _, resp in continuous_greedy(target.model, prompts, max_new_tokens=cfg.data.max_new_tokens, stop_ids=stops,
                                     slots=cfg.data.gen_batch_size):
        n_tok += len(resp)
    el = time.perf_counter() - t0
    row = {"recipe": recipe, "prompts": len(prompts), "max_new_tokens": cfg.data.max_new_tokens,
           "slots": cfg.data.gen_batch_size, "dtype": cfg.target.gen_dtype, "response_tokens": n_tok,
           "seconds": el, "tokens_per_s": n_tok / el,
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}
    if hf_baseline:
        tok, bs = target.tokenizer, cfg.data.gen_batch_size
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        t0, n_hf = time.perf_counter(), 0
        for b in range(0, len(order), bs):
            batch = [prompts[i] for i in order[b : b + bs]]
            width = max(map(len, batch))
            ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, p in enumerate(batch):
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            with torch.no_grad():
                out = target.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                            max_new_tokens=cfg.data.max_new_tokens, eos_token_id=stops,
                                            pad_token_id=tok.pad_token_id)
            for r in range(len(batch)):
                resp = out[r, width:].tolist()
                n_hf += next((i + 1 for i, t in enumerate(resp) if t in stops), len(resp))
        row["hf_generate_tokens_per_s"] = n_hf / (time.perf_counter() - t0)
    return row


def bench_training(recipe: str, steps: int, workdir: Path, processes: int = 1) -> dict:
    """One ``training/train.py`` run of ``steps`` steps (``processes`` > 1: under torchrun); its summary."""
    out = workdir / f"{recipe}-{processes}p"
    args = [f"recipe={recipe}", f"train.max_steps={steps}", f"output_dir={out}", "train.save_every_steps=0"]
    if processes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
               "training/train.py", *args, "train.threads=1"]
    else:
        cmd = [sys.executable, "training/train.py", *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"})
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    s = read_json(out / "summary.json", {"steps": int, "predictions_per_s": NUMBER, "peak_rss_gib": NUMBER,
                                         "train_min": NUMBER, "final_loss": NUMBER},
                  fix="the training run did not write a complete summary; run the benchmark again")
    return {"recipe": recipe, "processes": processes, "steps": s["steps"],
            "predictions_per_s": s["predictions_per_s"], "peak_rss_gib_rank0": s["peak_rss_gib"],
            "train_min": s["train_min"], "wall_s": time.perf_counter() - t0, "final_loss": s["final_loss"]}


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Returns 0, or 2 for bad arguments (argparse's own exit) or a training run's summary.json
    without the figures (one line naming it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["dflash_b16", "domino_b16", "dspark_b16"])
    ap.add_argument("--steps", type=int, default=40, help="optimiser steps per training run (default 40)")
    ap.add_argument("--regen-prompts", type=int, default=256,
                    help="prompts for the regeneration figure (default 256: several refills of every slot); 0 skips it")
    ap.add_argument("--hf-baseline", action="store_true", help="also time transformers' generate (slower)")
    ap.add_argument("--two-process", default="dspark_b16", help="recipe for the 2-process run ('' skips it)")
    ap.add_argument("--out", default="reports/bench.json")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.regen_prompts < 0:
        ap.error("--steps must be >= 1 and --regen-prompts >= 0")
    from rich.console import Console
    from rich.table import Table

    report: dict = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                                "threads": torch.get_num_threads()}}
    con = Console()
    if a.regen_prompts:
        con.print(f"regeneration: {a.regen_prompts} prompts of {a.recipes[0]} ...")
        report["regeneration"] = bench_regeneration(a.recipes[0], a.regen_prompts, a.hf_baseline)
    report["training"] = []
    with tempfile.TemporaryDirectory(prefix="dartree-bench-") as tmp:
        try:
            for recipe in a.recipes:
                con.print(f"training: {recipe}, {a.steps} steps ...")
                report["training"].append(bench_training(recipe, a.steps, Path(tmp)))
            if a.two_process:
                con.print(f"training: {a.two_process}, {a.steps} steps on 2 processes (torchrun, gloo) ...")
                report["training"].append(bench_training(a.two_process, a.steps, Path(tmp), processes=2))
        except RecordError as exc:  # a run's summary.json is incomplete: one line, exit 2
            return fail(exc)
    if "regeneration" in report:
        g = report["regeneration"]
        t = Table(title="regeneration (response tokens/s)")
        for c in ("recipe", "prompts", "slots", "dtype", "tokens/s", "hf generate tokens/s", "peak RSS GiB"):
            t.add_column(c)
        hf = g.get("hf_generate_tokens_per_s")
        t.add_row(g["recipe"], str(g["prompts"]), str(g["slots"]), g["dtype"], f"{g['tokens_per_s']:.0f}",
                  "-" if hf is None else f"{hf:.0f}", f"{g['peak_rss_gib']:.2f}")
        con.print(t)
    t = Table(title=f"training ({a.steps} steps)")
    for c in ("recipe", "processes", "predictions/s", "peak RSS GiB (rank 0)", "final loss"):
        t.add_column(c)
    for r in report["training"]:
        t.add_row(r["recipe"], str(r["processes"]), f"{r['predictions_per_s']:.0f}",
                  f"{r['peak_rss_gib_rank0']:.2f}", f"{r['final_loss']:.4f}")
    con.print(t)
    out = Path(a.out)
    write_file_atomically(out, json.dumps(report, indent=1))
    con.print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
