"""qn-hf-check: prove that a model trains the same under qn_hf at a mesh, before the big run.

    qn-hf-check MODEL [--dp D] [--tp T] [--pp P] [--cp C] [--dp-shard S] [--sequence-parallel] [--ep E]
                      [--microbatches M] [--layers L] [--model-class NAME]

MODEL is a Hugging Face directory or a config.json (only the config is read: a full-size config is
fine). A shrunk random copy of its exact architecture (same config class and model class, every
switch kept, small widths, L layers, dropout off) trains one SGD step on D*T*P*C local CPU processes
(gloo) and in one process; the loss and every weight after the step (read back through
``save_pretrained``) are compared, and the worst difference per tensor is printed. --dp-shard and
--ep add no processes: they shard the weights (FSDP) over dp ranks and the experts over dp x tp ranks.

--model-class trains another head of the architecture (``BertForQuestionAnswering``; default its
causal LM): its own loss where qn_hf computes it, else the mean square of its first output.

Exit status: 0 equal, 1 different, 2 refused (qn_hf raised a ValueError before any communication,
the input is bad, or the plain model fails on its own), 3 a rank crashed or timed out.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

import transformers

from ..arguments import plural
from ..config.dims import AXES, DEGREES
from ..config.parallel_config import ParallelConfig
from ..local_world import LocalWorld, WorldFailure
from ..training.words import mesh_words
from .run import LOSS_RTOL, WEIGHT_ATOL, WEIGHT_RTOL, Verdict, one_step_parity, parity_config
from .shrink import LAYERS, shrink_config

EXIT = {"equal": 0, "different": 1, "refused": 2, "fails alone": 2, "no batch": 2, "crashed": 3}
RANK_TIMEOUT_S = 600  # a whole check of a shrunk model takes seconds; a stuck collective gives up


def run_check(config: dict, *, parallel: ParallelConfig, model_class: str | None = None) -> dict:
    """Run the step on ``parallel``'s world of local ranks (qn_hf's launcher, ``local_world``) and
    return rank 0's verdict, or the failure of the first rank that crashed or timed out."""
    # ranks share the machine's cores: one thread each, as oversubscription only slows them
    with LocalWorld(parallel.dims.world_size, threads=1, collective_timeout=RANK_TIMEOUT_S) as world:
        try:
            return world.run(one_step_parity, timeout=RANK_TIMEOUT_S + 60, config=config, parallel=parallel,
                             model_class_name=model_class)[0]
        except WorldFailure as failure:
            return {"verdict": "crashed", "reason": str(failure)}


def _report(verdict: dict, *, top: int) -> str:
    lines = [f"{verdict['verdict'].upper()}" + (f": {verdict['reason']}" if verdict.get("reason") else "")]
    if verdict.get("loss") is not None:
        lines.append(f"loss {verdict['loss']:.9g} (plain model {verdict['ref_loss']:.9g}; tolerance {LOSS_RTOL:g} relative)")
        lines.append(f"largest change of any weight in the step: {verdict['moved']:.3g}")
        worst = verdict.get("worst", [])
        lines.append(f"worst |difference| beyond {WEIGHT_RTOL:g} x |weight| per tensor after the step (tolerance "
                     f"{WEIGHT_ATOL:g}), {min(top, len(worst))} "
                     f"of {len(worst)}:")
        lines += [f"  {d:10.3e}  {name}" for name, d in worst[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qn-hf-check", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="Hugging Face model directory or config.json")
    for spec in AXES:
        parser.add_argument(f"--{spec.axis.value.replace('_', '-')}", type=int, default=1,
                            help=f"how many ranks split {spec.splits} (default 1)")
    parser.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism inside tp")
    parser.add_argument("--microbatches", type=int, default=None, help="per step (default: pp)")
    parser.add_argument("--layers", type=int, default=LAYERS, help=f"layers of the shrunk copy (default {LAYERS})")
    parser.add_argument("--top", type=int, default=20, help="tensors to list, worst first (default 20)")
    parser.add_argument("--model-class", default=None,
                        help="the transformers class to train (any head, e.g. BertForSequenceClassification; default "
                             "the architecture's causal LM)")
    args = parser.parse_args(argv)
    for name in (*DEGREES, "layers", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    from ..planner.cli import load_config

    try:
        config = load_config(args.model)
    except SystemExit as e:  # load_config's own one-line error
        print(f"qn-hf-check: {e}", file=sys.stderr)
        return EXIT["refused"]
    # a class's own code may tie sizes its config does not (shrink_config's builds): the class named, if any
    builds = getattr(transformers, args.model_class, None) if args.model_class else None
    shrunk = shrink_config(config, layers=args.layers, builds=builds).to_dict()
    try:  # the degrees alone (the model's own refusals come from its ranks, before any collective)
        parallel = parity_config(**{name: getattr(args, name) for name in DEGREES},
                                 sequence_parallel=args.sequence_parallel, microbatches=args.microbatches)
    except ValueError as e:
        print(f"{config.model_type}: shrunk copy with {plural(args.layers, 'layer')}", flush=True)
        print(_report(asdict(Verdict(verdict="refused", reason=str(e))), top=args.top))
        return EXIT["refused"]
    print(f"{config.model_type}: shrunk copy with {plural(args.layers, 'layer')} at {mesh_words(parallel)} on "
          f"{plural(parallel.dims.world_size, 'CPU process')}, against the plain model", flush=True)
    verdict = run_check(shrunk, parallel=parallel, model_class=args.model_class)
    print(_report(verdict, top=args.top))
    return EXIT[verdict["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
