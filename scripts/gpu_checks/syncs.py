"""Host syncs: how often one steady training step makes the host wait for the GPU, and where.

On CUDA, torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) warns at every synchronizing
call; ``SyncSites`` records each warning's Python site as it is raised. On the CPU there is nothing to wait
for: the aten ops that would sync are counted instead, by benchmarks/host_syncs.py's dispatch counter.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch

from .common import build, llama_config, release, row, synchronize
from .common import device as this_device

ROOT = Path(__file__).resolve().parents[2]


def _where(path: str, line: int) -> str:
    """A frame's file, short: qn_hf/..., a site-packages module (transformers/..., torch/optim/...), or a name."""
    if "/qn_hf/" in path:
        return f"qn_hf/{path.rsplit('/qn_hf/', 1)[1]}:{line}"
    if "/site-packages/" in path:
        return f"{path.split('/site-packages/', 1)[1]}:{line}"
    return f"{path.rsplit('/', 1)[-1]}:{line}"


def _ours(path: str) -> bool:
    """qn_hf, or the user's script: gpu_check.py and its sections."""
    return "/qn_hf/" in path or "/gpu_checks/" in path or path.rsplit("/", 1)[-1] == "gpu_check.py"


def _not_torch(path: str) -> bool:
    """Outside torch's own modules (its optimizers and clipping count as the user's), the warnings machinery
    and frozen modules."""
    inside = "/torch/" in path and not any(p in path for p in ("/torch/optim/", "/torch/nn/utils/"))
    return not inside and not path.endswith("/warnings.py") and not path.startswith("<")


def sync_site(frame) -> str:
    """Where a synchronizing call came from: the innermost frame in qn_hf or the script, and (after "via")
    the innermost outside torch's own modules when that is another (transformers, torch.optim)."""
    ours = near = None
    while frame is not None and ours is None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if near is None and _not_torch(path):
            near = _where(path, frame.f_lineno)
        if _ours(path):
            ours = _where(path, frame.f_lineno)
        frame = frame.f_back
    site = ours or near or "unknown"
    return site if near in (None, site) else f"{site} via {near}"


class SyncSites:
    """CUDA's sync debug mode ("warn") around a block: each synchronizing call, counted by ``sync_site``.
    Torch raises the warning in the thread that called the op: syncs inside backward's kernels surface at the
    call that ran backward, those in Python hooks during backward at the hook."""

    def __init__(self, *, debug_mode: bool = True) -> None:
        self.sites: collections.Counter[str] = collections.Counter()
        self.debug_mode = debug_mode  # False: only the recording (tests raise the warnings themselves)
        self._catch = warnings.catch_warnings()  # restores the filters and showwarning on exit

    def __enter__(self) -> SyncSites:
        self._catch.__enter__()
        warnings.simplefilter("always")  # every sync, not once per site
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                self.sites[sync_site(sys._getframe(1))] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        if self.debug_mode:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.debug_mode:
            torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)


def _dispatch_counting():
    """benchmarks/host_syncs.py's ``counting`` (the aten ops that would make the host wait), loaded by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_host_syncs", ROOT / "benchmarks" / "host_syncs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.counting


@contextlib.contextmanager
def counted_syncs(opt: torch.optim.Optimizer, device: torch.device):
    """Yields a Counter of sync sites that the block fills: CUDA's sync debug mode on a GPU (the warnings come
    as the host makes the calls: no synchronize is needed to see them all), else the dispatch count."""
    if device.type == "cuda":
        with SyncSites() as sites:
            yield sites.sites
        return
    sites: collections.Counter[str] = collections.Counter()
    with _dispatch_counting()(opt, set()) as counter:
        yield sites
    sites.update({key.replace(" @ ", " at "): n for key, n in counter.syncs.items()})


def top(sites: collections.Counter, n: int = 4) -> str:
    return "; ".join(f"{count}x {site}" for site, count in sites.most_common(n)) or "none"


def host_syncs(*, quick: bool) -> list[dict]:
    """One steady step (zero_grad, forward and backward, clip, step; after two warm-up steps) per side, batch
    placement (host or device) and attention mask (none, or right padding): qn_hf at bf16 with
    ``qn_hf.optimizer`` and the plain model under autocast, each with AdamW (fused on a GPU)."""
    import qn_hf

    device = this_device()
    gpu = device.type == "cuda"
    config = llama_config(big=False, seq=64)
    ids = torch.randint(3, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 40:], mask[3, 50:] = 0, 0
    fused = {"fused": True} if gpu else {}
    rows = []
    for side in ("qn_hf", "plain"):
        model = build(config, device)
        if side == "qn_hf":
            pm = qn_hf.parallelize(model, device=device, mixed_precision="bf16")
            opt = qn_hf.optimizer(pm, torch.optim.AdamW, lr=1e-4, **fused)

            def step(batch: dict) -> None:
                opt.zero_grad()
                pm.train_step(batch)
                qn_hf.clip_grad_norm_(pm, 1.0)
                opt.step()
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)

            def step(batch: dict) -> None:
                opt.zero_grad(set_to_none=True)
                batch = {k: v.to(device) for k, v in batch.items()}  # what a user does; nothing when already there
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(**batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()

        for where in ("host", "device") if gpu else ("cpu",):  # on the CPU the host is the device
            for masked in (False, True):
                batch = {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100) if masked else ids}
                if masked:
                    batch["attention_mask"] = mask
                batch = {k: v.to(device) for k, v in batch.items()} if where == "device" else batch
                for _ in range(2):
                    step(batch)
                synchronize(device)
                with counted_syncs(opt, device) as sites:
                    step(batch)
                case = f"{side}, batch on {where}, {'attention mask' if masked else 'no mask'}"
                rows.append(row("host syncs", case, "measured", top(sites), syncs=sum(sites.values()),
                                sites=dict(sites), counter="cuda sync debug mode" if gpu else "aten dispatch"))
        model = opt = step = pm = None  # the device memory back before the other side runs
        release(device)
    return rows
