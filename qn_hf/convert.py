"""``qn-hf-convert``: between sharded qn_hf checkpoints, torch.distributed.checkpoint (DCP) directories and
Hugging Face directories, in one process.

The command line only (also ``python -m qn_hf.convert``); the conversions, which stream tensor by
tensor and need no GPU and no process group, are ``qn_hf.checkpoint.convert``.
"""

from __future__ import annotations

import argparse
import re
import sys

from .checkpoint.convert import from_hf, reshard, to_hf, unchecked_dcp, verify_against
from .checkpoint.dcp.torchtitan import KEY_MAPS
from .checkpoint.errors import CheckpointError, CheckpointFormat

EXAMPLES = """examples:
  qn-hf-convert from-hf ./gpt2-hf ./ckpt --tp 2 --pp 2     # start training at tp=2, pp=2 from a HF model
  qn-hf-convert reshard ./ckpt ./ckpt-tp4 --tp 4 --pp 1    # resume the same run at another mesh
  qn-hf-convert reshard ./ckpt ./ckpt-v2 --tp 1 --pp 2 --virtual-stages 2  # files laid out for interleaved 1F1B
  qn-hf-convert to-hf ./ckpt ./gpt2-trained                # back to AutoModel.from_pretrained
  qn-hf-convert to-hf ./ckpt ./gpt2-trained --overwrite    # replace an earlier export
  qn-hf-convert to-hf ./fsdp2-step-100 ./llama-trained --config ./llama-hf   # an FSDP2/accelerate DCP to HF
  qn-hf-convert reshard ./fsdp2-step-100 ./ckpt --tp 2 --pp 2 --config ./llama-hf  # a DCP as a qn_hf checkpoint
  qn-hf-convert from-hf ./gpt2-hf ./dcp --tp 1 --pp 1 --format dcp   # a HF model as a DCP for torch's FSDP2
  qn-hf-convert to-hf ./titan/step-1000 ./llama --config ./llama-hf --key-map torchtitan-llama  # torchtitan to HF
"""
SOURCE = ("a checkpoint directory (ckpt-<step>) or the directory holding them (its latest), or a "
          "torch.distributed.checkpoint directory (.metadata; accelerate's pytorch_model_fsdp_0 + optimizer_0)")
KEY_MAP = "another framework's names for a DCP's tensors (with --config): torchtitan-llama, its Llama 3"
CONFIG = ("for a DCP another framework wrote (no qn_hf.json): the Hugging Face directory of its model, or its "
          "config.json")


def _size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB or 500MiB")
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(float(match.group(1)) * units[(match.group(2) or "").upper()])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qn-hf-convert", description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-hf", help="sharded checkpoint -> Hugging Face directory", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", help=SOURCE)
    p.add_argument("out", help="the Hugging Face directory to write (config, generation config, safetensors)")
    p.add_argument("--max-shard-size", type=_size, default=_size("5GB"), help="largest output file (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace the model files of a non-empty OUT")
    p.add_argument("--config", help=CONFIG)
    p.add_argument("--key-map", choices=sorted(KEY_MAPS), help=KEY_MAP)
    p.add_argument("--verify-against", metavar="HF_DIR",
                   help="then compare every tensor written, bit for bit, with this Hugging Face directory (one you "
                        "trust, the checkpoint's source): a DCP torch wrote carries no checksums")
    for name, what in (("from-hf", "Hugging Face directory -> sharded checkpoint"), ("reshard", "checkpoint -> checkpoint at another mesh")):
        p = sub.add_parser(name, help=what, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("src", help="a Hugging Face model directory" if name == "from-hf" else SOURCE)
        p.add_argument("out", help="the directory to hold the new checkpoint (written as ckpt-<step>, then latest)")
        p.add_argument("--tp", type=int, required=True, help="tensor-parallel degree the checkpoint is laid out for")
        p.add_argument("--pp", type=int, required=True, help="pipeline stages the checkpoint is laid out for")
        p.add_argument("--virtual-stages", type=int, default=1,
                       help="chunks per pipeline stage (interleaved_1f1b) the files are laid out for (default 1)")
        p.add_argument("--format", choices=[f.value for f in CheckpointFormat], default=CheckpointFormat.QN.value,
                       help="qn: qn_hf's sharded checkpoint (default); dcp: a torch.distributed.checkpoint directory "
                            "that torch's FSDP2 loads with dcp.load + set_state_dict (each tensor whole: --tp/--pp "
                            "only check that the model splits so)")
        if name == "reshard":
            p.add_argument("--config", help=CONFIG)
            p.add_argument("--key-map", choices=sorted(KEY_MAPS), help=KEY_MAP)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        source = args.ckpt if args.command == "to-hf" else args.src
        if args.command != "from-hf" and unchecked_dcp(source):
            print(f"qn-hf-convert: note: {source} is a torch.distributed.checkpoint without checksums (qn_hf records "
                  f"its files' CRC-32s; torch does not): a damaged byte would convert unnoticed"
                  + ("" if getattr(args, "verify_against", None) else "; to-hf --verify-against HF_DIR compares the "
                     "result with a copy you trust"), file=sys.stderr)
        if args.command == "to-hf":
            left_out = to_hf(args.ckpt, args.out, max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
                             config=args.config, key_map=args.key_map)
            print(args.out)  # as from-hf and reshard print what they wrote
            if left_out:  # a converter never writes fewer tensors than it read without saying so
                print(f"qn-hf-convert: note: {args.out} holds the weights only; the checkpoint's optimizer state "
                      f"({len(left_out)} tensors) was left out (reshard keeps it)", file=sys.stderr)
            if args.verify_against:
                count = verify_against(args.out, args.verify_against)
                print(f"qn-hf-convert: verified: {count} tensors equal to {args.verify_against}'s", file=sys.stderr)
        elif args.command == "from-hf":
            print(from_hf(args.src, args.out, tp=args.tp, pp=args.pp, virtual_stages=args.virtual_stages,
                          format=CheckpointFormat(args.format)))
        else:
            print(reshard(args.src, args.out, tp=args.tp, pp=args.pp, virtual_stages=args.virtual_stages,
                          config=args.config, format=CheckpointFormat(args.format), key_map=args.key_map))
    except (CheckpointError, ValueError, OSError) as e:
        print(f"qn-hf-convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
