"""Writing a dartree checkpoint back to a published drafter layout (layer 3, the convert library): :func:`export`.
The command line is ``python convert/from_dartree.py`` (:mod:`dartree.convert.tools.from_dartree`), whose
docstring says which head type goes to which layout.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

from dartree.convert.export_config import with_target_context
from dartree.convert.publishers import EXPORT_FORMATS, FORMAT_PAIRS
from dartree.models.checkpoint import CheckpointError, load_dartree, read_safetensors
from dartree.base.files import write_folder_atomically


def _ensure_exportable_destination(dest: Path) -> None:
    """Refuse to overwrite anything but an earlier published drafter export (a folder whose config.json has
    ``dflash_config``).

    Raises:
        CheckpointError: ``dest`` is a file or a folder that is not such a checkpoint (nothing is touched).
    """
    if not dest.exists():
        return
    try:
        cfg = json.loads((dest / "config.json").read_text()) if dest.is_dir() else {}
        ok = "dflash_config" in cfg or "speculators_model_type" in cfg
    except (OSError, json.JSONDecodeError):
        ok = False
    if not ok:
        raise CheckpointError(f"refusing to overwrite {dest}: it exists and is not a published drafter checkpoint; "
                              "choose a new --out folder")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/model, as dartree.models.target.model_id reads one


def verifier_warning(name: str) -> str | None:
    """Why a speculators export whose ``verifier.name_or_path`` is ``name`` cannot be served on another machine (vLLM
    loads the verifier's embedding, lm_head and norm from that name), with the fix; None for a hub id (``org/model``
    that names no folder here)."""
    if _HUB_ID.match(name) and not Path(name).expanduser().exists():
        return None
    what = ("no verifier" if not name.strip() else
            f"the verifier as {name!r}, " + ("a local path" if Path(name).expanduser().exists() or "/" in name
                                            or "\\" in name else "not a hub id (org/model)"))
    return (f"the export records {what} (speculators_config.verifier.name_or_path), which another machine cannot "
            "load the verifier from; pass --verifier ORG/MODEL, the target's hub id")


def export(src: str | Path, out: str | Path, *, to: str, target=None, verifier: str | None = None) -> Path:
    """Write the dartree checkpoint ``src`` in the published layout ``to`` at ``out`` (atomically); returns ``out``.

    Args:
        src: dartree checkpoint folder. out: destination folder. to: one of :data:`EXPORT_FORMATS`.
        target: optional :class:`~dartree.models.target.Target`; layouts of the format registry use it (speculators:
            the verifier, and the lm_head rows of a reduced draft vocabulary).
        verifier: the target's model id to record (``_name_or_path``; speculators' ``verifier.name_or_path``) in
            place of the one derived from the target (:func:`dartree.models.target.model_id`), e.g. the hub id of a
            local folder that records none.
    Warns:
        UserWarning: a speculators export without ``verifier`` whose derived verifier is a local folder or no hub
            id (:func:`verifier_warning`; servers elsewhere load the verifier from it).
    Raises:
        CheckpointError: ``src`` is not a valid dartree checkpoint (strict load), ``to`` is unknown, the drafter
            does not fit ``target`` (both values named), or the drafter / head cannot be expressed in ``to`` (the
            message says why and what would fit); ``zlab-dflash`` from a checkpoint that records no target layer count
            (a converted speculators one) without ``target`` (z-lab's loader needs ``num_target_layers``).
    """
    src, out = Path(src), Path(out)
    if to not in EXPORT_FORMATS:
        raise CheckpointError(f"--to {to!r} is not one of {sorted(EXPORT_FORMATS)}")
    _ensure_exportable_destination(out)
    # strict: format, version, names, shapes; with a target, the pairing too (vocab, hidden size, layer ids, mask
    # id: check_target_pairing, as to_dartree.py --target and load_dartree(target=...) do), for every layout
    config = with_target_context(load_dartree(src, target=target).config, target)  # the context length to write
    tensors = read_safetensors(src / "model.safetensors")
    published, mapped = FORMAT_PAIRS[to].write(config, tensors, target, where=src)
    if verifier:
        if "speculators_config" in published:
            published["speculators_config"]["verifier"]["name_or_path"] = verifier
        else:
            published["_name_or_path"] = verifier
    elif "speculators_config" in published:
        problem = verifier_warning(published["speculators_config"]["verifier"].get("name_or_path") or "")
        if problem:
            warnings.warn(problem, UserWarning, stacklevel=2)
    write_folder_atomically(out, {"config.json": json.dumps(published, indent=2).encode(),
                                  "model.safetensors": {"tensors": mapped, "metadata": {"format": "pt"}}})
    return out
