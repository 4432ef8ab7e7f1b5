"""qn-hf-check: prove that a model trains the same under qn_hf at a mesh, before the big run.

    qn-hf-check MODEL [--dp D] [--tp T] [--pp P] [--ep E] [--microbatches M] [--layers L]

MODEL is a Hugging Face directory or a config.json (only the config is read: a full-size config is
fine). A shrunk random copy of its exact architecture (same config class and model class, every
switch kept, small widths, L layers, dropout off) trains one SGD step on D*T*P local CPU processes
(gloo) and in one process; the loss and every weight after the step (read back through
``save_pretrained``) are compared, and the worst difference per tensor is printed.

Exit status: 0 equal, 1 different, 2 refused (qn_hf raised a ValueError before any communication,
or the input is bad), 3 a rank crashed or timed out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback

from ..mesh import free_local_port
from .run import LOSS_RTOL, WEIGHT_ATOL
from .shrink import LAYERS, shrink_config

EXIT = {"equal": 0, "different": 1, "refused": 2, "crashed": 3}
RANK_TIMEOUT_S = 600  # a whole check of a shrunk model takes seconds; a stuck collective gives up


def _rank(rank: int, world: int, port: int, config: dict, mesh: dict, results) -> None:
    """One process of the check (spawned): join the gloo world, run the step, report."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    import transformers

    from ..mesh import init_distributed
    from .run import one_step_parity

    torch.set_num_threads(1)  # ranks share the machine's cores: oversubscription only slows them
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        init_distributed(device=torch.device("cpu"), timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))  # gloo
        verdict = one_step_parity(config=config, **mesh)
        results.put((rank, verdict))
    except BaseException:  # noqa: BLE001 - the parent reports it and stops the others
        results.put((rank, {"verdict": "crashed", "reason": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_check(config: dict, *, dp: int, tp: int, pp: int, microbatches: int | None, ep: int = 1) -> dict:
    """Spawn dp*tp*pp ranks and return rank 0's verdict (or the first crash); ``ep`` shards MoE experts
    over ranks of those (it adds none)."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    world = dp * tp * pp
    results = ctx.Queue()
    mesh = {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "microbatches": microbatches}
    port = free_local_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, config, mesh, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    verdicts: dict[int, dict] = {}
    try:
        while len(verdicts) < world:
            try:
                rank, verdict = results.get(timeout=RANK_TIMEOUT_S + 60)
            except queue.Empty:
                return {"verdict": "crashed", "reason": f"no result within {RANK_TIMEOUT_S + 60} s"}
            if verdict["verdict"] == "crashed":
                return {**verdict, "reason": f"rank {rank} failed:\n{verdict['reason']}"}
            verdicts[rank] = verdict
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return verdicts[0]


def _report(verdict: dict, *, top: int) -> str:
    lines = [f"{verdict['verdict'].upper()}" + (f": {verdict['reason']}" if verdict.get("reason") else "")]
    if verdict.get("loss") is not None:
        lines.append(f"loss {verdict['loss']:.9g} (plain model {verdict['ref_loss']:.9g}; tolerance {LOSS_RTOL:g} relative)")
        lines.append(f"largest change of any weight in the step: {verdict['moved']:.3g}")
        worst = verdict.get("worst", [])
        lines.append(f"worst |difference| per tensor after the step (tolerance {WEIGHT_ATOL:g}), {min(top, len(worst))} "
                     f"of {len(worst)}:")
        lines += [f"  {d:10.3e}  {name}" for name, d in worst[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qn-hf-check", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="Hugging Face model directory or config.json")
    for dim in ("dp", "tp", "pp", "ep"):
        parser.add_argument(f"--{dim}", type=int, default=1, help=f"{dim} degree (default 1)")
    parser.add_argument("--microbatches", type=int, default=None, help="per step (default: pp)")
    parser.add_argument("--layers", type=int, default=LAYERS, help=f"layers of the shrunk copy (default {LAYERS})")
    parser.add_argument("--top", type=int, default=20, help="tensors to list, worst first (default 20)")
    args = parser.parse_args(argv)
    for name in ("dp", "tp", "pp", "ep", "layers", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be at least 1")
    from ..planner.cli import load_config

    try:
        config = load_config(args.model)
    except SystemExit as e:  # load_config's own one-line error
        print(f"qn-hf-check: {e}", file=sys.stderr)
        return EXIT["refused"]
    shrunk = shrink_config(config, layers=args.layers).to_dict()
    experts = f" ep={args.ep}" if args.ep > 1 else ""
    print(f"{config.model_type}: shrunk copy with {args.layers} layers at dp={args.dp} tp={args.tp} pp={args.pp}{experts} "
          f"on {args.dp * args.tp * args.pp} CPU process(es), against the plain model", flush=True)
    verdict = run_check(shrunk, dp=args.dp, tp=args.tp, pp=args.pp, ep=args.ep, microbatches=args.microbatches)
    print(_report(verdict, top=args.top))
    return EXIT[verdict["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
