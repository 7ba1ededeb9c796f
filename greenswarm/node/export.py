"""Models out: a site's global model as a Hugging Face model directory (``greenswarm export``).

A checkpoint holds the global model as one flat fp32 vector (the outer step's state, the same on every
rank layout: an FSDP site gathers it to rank 0 before saving) and nothing else knows that format. So
the node writes ``run_dir/model.json`` when it starts -- the transformers config it built, the
tokenizer, and every parameter's name and shape in the vector's order -- and :func:`export_run` cuts
the vector back into named tensors, loads them into the architecture and writes
``save_pretrained``'s safetensors and config, plus the tokenizer where the site has one. What
``AutoModelForCausalLM.from_pretrained(OUT)`` then loads computes the node's logits exactly (the same
fp32 weights through the same transformers code).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from greenswarm.averaging.outer import unflatten
from greenswarm.errors import ConfigError, GreenswarmError
from greenswarm.node.checkpoint import Checkpointer
from greenswarm.node.evaluation import BEST_DIR, INDEX, BestEntry
from greenswarm.node.model import ModelConfig, ModelIdentity

log = logging.getLogger(__name__)

#: what a node writes into its run_dir at start: the architecture and the flat vector's layout
MODEL_FILE = "model.json"
#: what an export writes beside the weights: where they came from
PROVENANCE_FILE = "greenswarm.json"
FORMAT = 1


def describe_model(run_dir: str | Path, model: torch.nn.Module, names: list[str], shapes: list[Any],
                   model_cfg: ModelConfig, identity: Any) -> Path:  # fmt: skip
    """Write ``run_dir/model.json``: everything :func:`export_run` needs besides the checkpoint.

    ``names``/``shapes``: the parameters in the order of the flat vector (taken before FSDP shards
    them). Rewritten at every start, so it always matches the checkpoints the run writes next.
    """
    config = json.loads(model.config.to_json_string(use_diff=False))  # type: ignore[union-attr]
    tokenizer = model_cfg.tokenizer
    if tokenizer != "bytes":
        tokenizer = str(Path(tokenizer).expanduser().resolve())
    content = {
        "format": FORMAT,
        "source": model_cfg.source,
        "identity": identity.to_wire(),
        "tokenizer": tokenizer,
        "config": config,
        "parameters": [[name, list(shape)] for name, shape in zip(names, shapes, strict=True)],
    }
    path = Path(run_dir) / MODEL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(content, indent=1))
    os.replace(partial, path)  # a reader never sees half of it
    return path


def export_run(
    run_dir: str | Path, out: str | Path, *, best: bool = False, force: bool = False
) -> dict[str, Any]:
    """Write the global model of the site whose run directory is ``run_dir`` (its newest verified
    checkpoint, or with ``best`` its best kept one by held-out loss) to ``out`` as a Hugging Face model
    directory. Returns what it wrote, for the CLI's report."""
    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser().resolve()
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such directory (a site's node.run_dir)", field="--run-dir")
    described = _read_description(run_dir)
    payload, source, kept = _checkpoint(run_dir, best)
    names = [str(name) for name, _ in described["parameters"]]
    shapes = [torch.Size(shape) for _, shape in described["parameters"]]
    flat = payload["outer"][0]  # the global model: what a kept checkpoint's held-out loss measured too
    expected = sum(s.numel() for s in shapes)
    if flat.numel() == 2 * expected and _holds_z(described):
        flat = flat[:expected]  # schedule-free x, then the z the swarm averages too: the model is x
    if flat.numel() != expected:
        raise GreenswarmError(
            f"{source} holds a model of {flat.numel():,} values, but {run_dir / MODEL_FILE} describes "
            f"{expected:,}: the run directory was reused for another model"
        )
    _check_out(out, run_dir, force)

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the command prints what it wrote, once
    model = _rebuild(described["config"], names, shapes, flat)
    site = payload.get("site", {})
    provenance = {
        "run_dir": str(run_dir.resolve()),
        "checkpoint": str(source),
        "outer_round": site.get("outer_round"),
        "lineage": site.get("lineage"),
        "held_out_loss": kept.loss if kept else None,
        "model": "the global model (its held-out loss measured this one)" if best else "the global model",
        "identity": described["identity"],
        "source": described["source"],
        "tokenizer": described["tokenizer"],
    }
    try:
        _write(model, provenance, out)
    except OSError as e:  # a full disk, no permission, a path through a file
        raise ConfigError(f"cannot write {out}: {e.strerror or e}", field="--out") from None
    params = sum(p.numel() for p in model.parameters())
    return {
        "out": str(out),
        "parameters": params,
        "architecture": model.config.model_type,
        "files": sorted(p.name for p in out.iterdir()),
        **provenance,
    }


def _check_out(out: Path, run_dir: Path, force: bool) -> None:
    """Refuse an ``out`` that would overwrite the run itself, or anything but an earlier export."""
    target, run = out.resolve(), run_dir.resolve()
    if target == run or run in target.parents or target in run.parents:
        raise ConfigError(
            f"{out} is the run directory {run_dir}, inside it or above it; write the model elsewhere",
            field="--out",
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; name a directory to write the model into", field="--out")
    if out.is_dir() and any(out.iterdir()):
        if not (out / PROVENANCE_FILE).is_file():
            raise ConfigError(
                f"{out} is not empty and holds no earlier export ({PROVENANCE_FILE}); name a new directory",
                field="--out",
            )
        if not force:
            raise ConfigError(f"{out} holds an earlier export; pass --force to replace it", field="--out")


def _write(model: Any, provenance: dict[str, Any], out: Path) -> None:
    """Write the directory beside ``out`` and swap it in: a reader finds the old export or the new one
    (an earlier one is moved aside first and removed last)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    old = out.with_name(f".{out.name}.old")
    try:
        model.save_pretrained(staging)
        provenance["tokenizer_saved"] = _save_tokenizer(provenance["tokenizer"], staging)
        (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)  # put the earlier export back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _read_description(run_dir: Path) -> dict[str, Any]:
    path = run_dir / MODEL_FILE
    try:
        described = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{run_dir} has no {MODEL_FILE} (a node writes it when it starts; run directories from before "
            "greenswarm wrote it cannot be exported)",
            field="--run-dir",
        ) from None
    except (OSError, ValueError) as e:
        raise GreenswarmError(f"{path}: unreadable ({e})") from None
    if not isinstance(described, dict) or described.get("format") != FORMAT:
        raise GreenswarmError(f"{path}: not a model description this greenswarm reads")
    return described


def _checkpoint(run_dir: Path, best: bool) -> tuple[dict[str, Any], Path, BestEntry | None]:
    """The verified checkpoint to export: the newest, or the best kept one; with its kept entry."""
    checkpointer = Checkpointer(run_dir)
    if not best:
        payload = checkpointer.load(mmap=True)
        if payload is None:
            raise GreenswarmError(f"{run_dir} holds no verified checkpoint (checkpoint.pt)")
        return payload, checkpointer.path, None
    for entry in sorted(kept_best(run_dir), key=BestEntry.key):
        path = run_dir / BEST_DIR / entry.file
        payload = checkpointer.read(path, mmap=True)
        if payload is not None:
            return payload, path, entry
        log.warning("%s does not verify; trying the next best", path)
    raise GreenswarmError(
        f"{run_dir / BEST_DIR} holds no verified checkpoint (the site keeps its best ones with "
        "eval.keep_best > 0); export the newest without --best"
    )


def kept_best(run_dir: Path) -> list[BestEntry]:
    """The best checkpoints a site kept, from its index (or from the files' names when the index is
    lost), read without changing anything."""
    directory = run_dir / BEST_DIR
    try:
        items = json.loads((directory / INDEX).read_text())
        entries = [BestEntry.from_json(item) for item in items]
    except (OSError, ValueError, TypeError, KeyError):
        entries = [e for p in directory.glob("*.pt") if (e := BestEntry.from_name(p)) is not None]
    return [e for e in entries if (directory / e.file).is_file()]


def _holds_z(described: dict[str, Any]) -> bool:
    """Whether the run's global state is schedule-free ``x`` followed by ``z`` (``train.sf_z: average``)."""
    identity = ModelIdentity.from_wire(str(described.get("identity", "")))
    return identity is not None and identity.state == "x+z"


def _rebuild(
    config_dict: dict[str, Any], names: list[str], shapes: list[torch.Size], flat: torch.Tensor
) -> Any:
    """The architecture of ``config_dict`` holding the checkpoint's vector, in fp32 on the CPU."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
    config.use_cache = True  # trained without a KV cache; inference wants one
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = dict(model.named_parameters())
    if list(params) != names:
        raise GreenswarmError(
            "the model's parameters differ from the run's description (another transformers version?): "
            f"{len(params)} named here, {len(names)} in model.json"
        )
    with torch.no_grad():
        for (name, param), value in zip(params.items(), unflatten(flat, shapes), strict=True):
            if param.shape != value.shape:
                raise GreenswarmError(
                    f"{name}: shape {tuple(param.shape)} here, {tuple(value.shape)} in the run"
                )
            param.copy_(value)
    model.eval()
    return model


def _save_tokenizer(spec: str, out: Path) -> str:
    """Save the site's tokenizer beside the weights; what was done, in words."""
    if spec == "bytes":
        return (
            "none: the site used greenswarm's byte tokenizer (token = UTF-8 byte 0-255; 256 BOS, 257 EOS, "
            "258 PAD)"
        )
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(spec, local_files_only=True).save_pretrained(out)
    except Exception as e:  # the directory moved since the run, or cannot be read
        log.warning("the run's tokenizer %s could not be saved with the model: %s", spec, e)
        return f"not saved: {spec} could not be read ({type(e).__name__})"
    return f"saved from {spec}"


def print_export(report: dict[str, Any], as_json: bool) -> None:
    """The CLI's report of an export."""
    if as_json:
        print(json.dumps(report))
        return
    loss = report["held_out_loss"]
    print(
        f"wrote {report['out']} ({report['model']}): {report['architecture']}, {report['parameters']:,} "
        "parameters, "
        f"outer step {report['outer_round']}"
        + (f", held-out loss {loss:.4f}" if loss is not None else "")
        + f" (from {report['checkpoint']})"
    )
    print(f"tokenizer: {report['tokenizer_saved']}")
    print(f"load it with: AutoModelForCausalLM.from_pretrained({report['out']!r})")
