"""Checkpoints with torch.distributed.checkpoint (DCP): atomic saves, checks that need no process
group, and resumes on another mesh, capture mode or activation-checkpointing setting.

Layout under `<job.dump_folder>/<checkpoint.folder>`:

    step-N/        complete: the DCP files and `meta.json`, which is written last, after which the
                   folder is renamed from step-N.tmp; only such folders are ever loaded
    step-N.tmp/    a save in progress, or one that died: ignored, removed by the next save

`meta.json` holds the step, the model's parameter FQNs and global shapes, the data settings the
loader position depends on, and the size and CRC32 of every file, so that a checkpoint of another
model or one whose files were damaged is refused with a message naming its folder. Sizes are checked
before any process group exists (`select_checkpoint`, used by the validator); checksums are checked
at load, each rank reading a share of the files.

State keys are FQNs as `get_model_state_dict` / `get_optimizer_state_dict` return them, without
wrapper prefixes such as `_checkpoint_wrapped_module`, and parameters are DTensors that DCP
reshards: a checkpoint saved on one mesh loads on any other.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .config import JobConfig

logger = logging.getLogger("graph_trainer")

META_FILE = "meta.json"
FORMAT_VERSION = 1
_COMPLETE = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^step-\d+\.(tmp|old)$")
_CRC_CHUNK = 1 << 24


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names its folder and the fix."""


def checkpoint_root(cfg: JobConfig) -> Path:
    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """`(step, folder)` of every completely written checkpoint, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _COMPLETE.match(p.name))]
    return sorted(found)


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _data_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != META_FILE)


def read_meta(folder: Path) -> dict[str, Any]:
    """meta.json of a complete checkpoint, after checking that every file it lists is there with its size."""
    path = folder / META_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} has no {META_FILE} (it was not written by a finished save)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder} has an unreadable {META_FILE} ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"checkpoint {folder} has a {META_FILE} of an unknown format")
    for name, (size, _) in meta["files"].items():
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {folder} is incomplete: file {name} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint {folder} is corrupt: file {name} has {file.stat().st_size} bytes, {size} were written")
    return meta


def select_checkpoint(
    root: Path, load_step: int, fallback: bool, check: Callable[[Path], dict[str, Any]] = read_meta
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from: step `load_step` (-1: the latest), or None when there is none.

    A checkpoint that fails `check` stops the run unless `fallback` is set; then the newest older
    one that passes is taken. Every rank reaches the same answer from the same files.
    """
    found = complete_checkpoints(root)
    if load_step >= 0:
        if load_step not in {step for step, _ in found}:
            steps = ", ".join(str(step) for step, _ in found) or "none"
            raise CheckpointError(
                f"no complete checkpoint step-{load_step} in {root} (complete steps: {steps}); "
                "pick one of them with --checkpoint.load_step, or -1 for the latest"
            )
        found = [(step, path) for step, path in found if step <= load_step]
    for _, path in reversed(found):
        try:
            return path, check(path)
        except CheckpointError as e:
            if not fallback:
                raise CheckpointError(
                    f"{e}; delete that folder, pick another step with --checkpoint.load_step, "
                    "or pass --checkpoint.fallback_to_previous"
                ) from None
            logger.warning(f"{e}; falling back to the previous checkpoint")
    if found:
        raise CheckpointError(f"every checkpoint in {root} is corrupt; delete them or point --checkpoint.folder elsewhere")
    return None


def state_shapes(state_dict: dict[str, Any]) -> dict[str, list[int]]:
    """Global shape of every tensor of a model state dict (DTensors report their global shape)."""
    return {k: list(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def check_same_model(folder: Path, meta: dict[str, Any], shapes: dict[str, list[int]], what: str) -> None:
    """Refuse a checkpoint whose parameters differ from this run's model in names or shapes."""
    saved = meta.get("params", {})
    missing = sorted(set(shapes) - set(saved))
    extra = sorted(set(saved) - set(shapes))
    reshaped = sorted(k for k in set(saved) & set(shapes) if saved[k] != shapes[k])
    if not (missing or extra or reshaped):
        return
    if reshaped:
        k = reshaped[0]
        detail = f"{k} has shape {saved[k]} there and {shapes[k]} here"
    elif missing:
        detail = f"it lacks {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    else:
        detail = f"it holds {extra[0]}, which this model lacks" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
    raise CheckpointError(
        f"checkpoint {folder} holds another model ({meta.get('model', '?')}; {detail}); resume with the "
        f"model it was saved with, or point --checkpoint.folder elsewhere to train {what} from scratch"
    )


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when the flag is set on at least one."""
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class Checkpointer:
    """Saves and loads `state` (name -> Stateful) under `checkpoint_root(cfg)`.

    Every method is collective: all ranks call it at the same step.
    """

    def __init__(self, cfg: JobConfig, state: dict[str, Any], describe: dict[str, Any], device: torch.device):
        self.cfg = cfg
        self.c = cfg.checkpoint
        self.root = checkpoint_root(cfg)
        self.state = state
        self.describe = describe
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def due(self, step: int, stopping: bool) -> bool:
        return self.c.enable and (stopping or step % self.c.interval == 0 or step == self.cfg.training.steps)

    def load(self) -> int | None:
        """Restore the state from the selected checkpoint; its step, or None for a fresh start."""
        if not self.c.enable:
            return None
        chosen = select_checkpoint(self.root, self.c.load_step, self.c.fallback_to_previous, self._verified_meta)
        if chosen is None:
            return None
        folder, meta = chosen
        try:
            dcp.load(self.state, checkpoint_id=str(folder))
        except Exception as e:  # noqa: BLE001  (whatever DCP or a Stateful raises, the folder is what to name)
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {folder} cannot be loaded ({reason}); delete it or pick another with --checkpoint.load_step") from e
        if self.rank == 0:
            logger.info(f"resumed from {folder} (step {meta['step']})")
        return int(meta["step"])

    def _verified_meta(self, folder: Path) -> dict[str, Any]:
        """read_meta plus checksums: each rank reads every world-th file, and all ranks agree on the verdict."""
        meta = read_meta(folder)
        names = sorted(meta["files"])[self.rank :: self.world]
        bad = next((n for n in names if _crc32(folder / n) != meta["files"][n][1]), None)
        if any_rank(bad is not None, self.device):
            which = f"file {bad}" if bad else "a file checked by another rank"
            raise CheckpointError(f"checkpoint {folder} is corrupt: {which} does not match its checksum")
        return meta

    def save(self, step: int) -> Path:
        """Write step-N.tmp, record sizes and checksums in meta.json, then rename it to step-N."""
        tmp = self.root / f"step-{step}.tmp"
        final = self.root / f"step-{step}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save(self.state, checkpoint_id=str(tmp))
        names = _data_files(tmp)
        mine = {n: [(tmp / n).stat().st_size, _crc32(tmp / n)] for n in names[self.rank :: self.world]}
        shares: list[dict[str, list[int]]] = [{} for _ in range(self.world)]
        dist.all_gather_object(shares, mine)
        if self.rank == 0:
            files = {n: v for share in shares for n, v in share.items()}
            meta = {"format": FORMAT_VERSION, "step": step, "files": files, **self.describe}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
            if final.exists():
                old = self.root / f"step-{step}.old"
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
            tmp.rename(final)
            self._purge()
            logger.info(f"saved checkpoint {final}")
        dist.barrier()
        return final

    def _purge(self) -> None:
        """Leftovers of earlier saves, and complete checkpoints beyond keep_latest_k."""
        doomed = [p for p in self.root.iterdir() if _LEFTOVER.match(p.name)]
        if self.c.keep_latest_k > 0:
            doomed += [path for _, path in complete_checkpoints(self.root)[: -self.c.keep_latest_k]]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
