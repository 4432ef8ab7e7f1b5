"""What ``qn-hf-plan`` prints: one mesh in detail (``mesh_report``), the ranking of many
(``ranking_report``), the JSON of one mesh (``to_json``), each with its step time at the given
calibration (``cost.step_time``; None: the stated figures of ``Hardware``)."""

from __future__ import annotations

from collections.abc import Mapping

from ..config.dims import AXES
from ..config.layout import GroupRole
from ..config.schedule import as_schedule
from .calibration import Calibration
from .cost import COMM_PARTS, GIB, Hardware, links, step_time
from .results import MeshEstimate
from .search import Candidate


def gib(n: float) -> str:
    return f"{n / GIB:,.1f}"


def settings(*, mixed_precision: str | None, zero: bool, recompute: str | None, sequence_parallel: bool = False,
             dp_shard: int = 1, loss_chunk_tokens: int | None = None, offload: str | None = None) -> str:
    """The training settings, in words."""
    words = [mixed_precision or "fp32"] + (["ZeRO-1"] if zero else []) + ([f"{recompute} recompute"] if recompute else [])
    return ", ".join(words + (["sequence parallel"] if sequence_parallel else [])
                     + ([f"dp_shard={dp_shard} (FSDP)"] if dp_shard > 1 else [])
                     + ([f"the loss {loss_chunk_tokens} tokens at a time"] if loss_chunk_tokens else [])
                     + ([f"{offload} offloaded to the host"] if offload else []))


def crossing(link: dict[str, str]) -> list[str]:
    """The groups whose ranks lie on two nodes or more (``links``' "ib"; "replicas" is named "dp" there)."""
    return [group for group, kind in link.items() if kind == "ib" and group != GroupRole.GRADIENT_SUM]


def mesh_report(est: MeshEstimate, hw: Hardware, calibration: Calibration | None = None) -> str:
    link = links(est, hw)
    t = step_time(est, hw, calibration)
    master = " + fp32 master" if est.mixed_precision else ""
    ep = est.ep > 1  # an ep column and link only then: dense-model reports stay as they were
    stash = as_schedule(est.schedule).split_backward  # a W stash column only then
    fsdp = est.dp_shard > 1  # a column of the whole weights and gradients a step holds only then
    p = est.parallel
    words = settings(mixed_precision=est.mixed_precision, zero=est.zero, recompute=est.recompute,
                     sequence_parallel=est.sequence_parallel, dp_shard=est.dp_shard,
                     loss_chunk_tokens=p.loss_chunk_tokens, offload=p.offload and p.offload.value)
    lines = [
        f"mesh dp={est.dp} tp={est.tp} pp={est.pp} cp={est.cp}{f' ep={est.ep}' if ep else ''} "
        f"({est.world_size} GPUs), {schedule_name(est)}, {est.microbatches} microbatches of {est.micro_batch_size} x "
        f"{est.seq_len} positions (a global batch of {est.global_batch} sequences); {est.total_params:,} parameters; "
        f"{words}"
        + (f", gathered once a {est.dp_shard_gather}" if fsdp and est.pp > 1 else ""),
        f"bubble of {est.schedule} {est.bubble:.3f} (its action lists timed with per-op costs from FLOPs); "
        f"links: tp {link['tp']}, cp {link['cp']}, pp {link['pp']}, "
        f"dp {link['dp']}" + (f", ep {link['ep']}, experts {link['experts']}" if ep else "")
        + f"; groups across nodes ({hw.gpus_per_node} GPUs a node): {', '.join(crossing(link)) or 'none'}",
        "",
        f"| stage | blocks | also holds | params / rank | weights GiB | grads GiB | AdamW{master} GiB "
        f"| activations / microbatch GiB |{' W stash / microbatch GiB |' if stash else ''} in flight "
        f"| peak activations GiB |{' gathered GiB |' if fsdp else ''} total GiB | tp GB/step | cp GB/step | pp GB/step | dp GB/step (payload) |"
        + (" ep GB/step |" if ep else ""),
        "|---" * (15 + stash + ep + fsdp) + "|",
    ]
    for s in est.stages:
        comm = group_gb(s.comm)
        blocks = ", ".join(f"{stack + ' ' if stack else ''}{first}-{last - 1}"
                           for (first, last), stack in zip(s.chunks, s.stacks or ("",) * len(s.chunks)))
        lines.append(
            f"| {s.stage} | {blocks} | {', '.join(s.modules) or '-'} | {s.params:,} "
            f"| {gib(s.weight_bytes)} | {gib(s.grad_bytes)} | {gib(s.optimizer_bytes)} "
            f"| {gib(s.activation_bytes_per_microbatch)} |"
            + (f" {gib(s.weight_stash_bytes_per_microbatch)} |" if stash else "")
            + f" {s.in_flight} | {gib(s.activation_bytes)} |" + (f" {gib(s.unsharded_bytes)} |" if fsdp else "")
            + f" {gib(s.total_bytes)} "
            f"| {comm['tp']:.2f} | {comm['cp']:.2f} | {comm['pp']:.2f} | {comm['dp']:.2f} |"
            + (f" {comm['ep']:.2f} |" if ep else "")
        )
    fits = est.peak_bytes <= hw.gpu_memory
    host = f"; {gib(est.host_peak_bytes)} GiB of host memory per GPU for the offload" if est.host_peak_bytes else ""
    lines += ["", f"peak {gib(est.peak_bytes)} GiB per GPU of {gib(hw.gpu_memory)} GiB: {'fits' if fits else 'DOES NOT FIT'}"
              + host, f"estimated step {t.seconds:.2f} s (compute+bubble {t.compute:.2f}, tp {t.tp:.2f}, cp {t.cp:.2f}, "
              f"pp {t.pp:.2f}, dp {t.dp:.2f}{f', ep {t.ep:.2f}' if ep else ''}, optimizer {t.optimizer:.2f}, "
              f"waits {t.wait:.2f}{f', offload copies {t.offload:.2f}' if t.offload else ''}), {t.tokens_per_s:,.0f} tokens/s, "
              f"{100 * t.utilization:.0f}% of the peak matmul rate"
              + (f"; assumed, not measured: {', '.join(t.assumed)}" if t.assumed else "")]
    return "\n".join(lines)


def schedule_name(est: MeshEstimate) -> str:
    return est.schedule + (f" x{est.virtual_stages} virtual stages" if est.virtual_stages > 1 else "")


def group_gb(comm: dict) -> dict[str, float]:
    """GB per step on tp, cp, pp, dp and ep, where dp is the gradients' reductions: "dp" plus
    "replicas" (dp x cp) plus "experts" (the ep-sharded experts' own group) plus FSDP's
    ("dp_shard": its all-gathers too; "dp_replicate")."""
    gb = {g: comm[g].nbytes / 1e9 if g in comm else 0.0 for g in COMM_PARTS}
    summed = (GroupRole.GRADIENT_SUM, GroupRole.EXPERT_SUM, GroupRole.WEIGHT_SHARD, GroupRole.SHARD_REPLICAS)
    gb[GroupRole.BATCH] += sum(comm[g].nbytes / 1e9 for g in summed if g in comm)
    return gb


def mesh_name(degrees: Mapping[str, int]) -> str:
    """``dp=2 tp=1 pp=1``, then each other degree above 1 (``cp=2 ep=2 dp_shard=2``), from the degrees by name."""
    shown = [spec for spec in AXES if spec.named_at_one and spec.mesh is not None or degrees.get(spec.axis, 1) > 1]
    return " ".join(f"{spec.axis}={degrees.get(spec.axis, 1)}" for spec in shown)


def ranking_report(accepted: list[Candidate], rejected, *, hw: Hardware, top: int, label: str, ep: int | None = 1,
                   dp_shard: bool = False) -> str:
    """``ep``: the meshes' ep, or None when it was searched (an ep column); ``dp_shard``: a dp_shard
    column (the meshes were planned with sharded data parallelism)."""
    moe = ep is None or ep > 1  # an ep GB column
    lines = [
        f"| rank | dp |{' dp_shard |' if dp_shard else ''} tp | pp | cp |{' ep |' if ep is None else ''} microbatches "
        f"| global batch | bubble | peak GiB / GPU ({label}) "
        f"| fits {gib(hw.gpu_memory)} GiB | est. step s | tokens/s | tp GB | cp GB | pp GB | dp GB |"
        + (" ep GB |" if moe else ""),
        "|---" * (16 + moe + dp_shard + (ep is None)) + "|",
    ]
    for i, c in enumerate(accepted[:top], 1):
        e = c.estimate
        per_stage = [group_gb(s.comm) for s in e.stages]
        worst = {g: max(gb[g] for gb in per_stage) for g in COMM_PARTS}
        lines.append(
            f"| {i} | {e.dp} |" + (f" {e.dp_shard} |" if dp_shard else "") + f" {e.tp} | {e.pp} | {e.cp} |"
            + (f" {e.ep} |" if ep is None else "") + f" {e.microbatches} | {e.global_batch} | {e.bubble:.3f} "
            f"| {gib(c.peak_bytes)} "
            f"| {'yes' if c.fits else 'no'} | {c.time.seconds:.2f} | {c.time.tokens_per_s:,.0f} | {worst['tp']:.1f} "
            f"| {worst['cp']:.1f} | {worst['pp']:.1f} | {worst['dp']:.1f} |"
            + (f" {worst['ep']:.1f} |" if moe else "")
        )
    lines.append("\nGB columns: per step and GPU (the busiest stage), the payload this rank hands to the group's "
                 "collectives and sends (dp: its gradient buckets); a ring all-reduce puts 2(N-1)/N of its payload "
                 "on the wire.")
    batches = sorted({c.estimate.global_batch for c in accepted[:top]})
    if len(batches) > 1:
        lines.append(f"These meshes train different global batches ({', '.join(map(str, batches))} sequences per "
                     f"step), so their tokens/s compare different runs: --global-batch B ranks meshes that train B.")
    if len(accepted) > top:
        lines.append(f"\n({len(accepted) - top} more valid meshes; --top N shows more)")
    if rejected:
        lines.append(f"\nrejected by parallelize's checks ({len(rejected)}):")
        lines += [f"  {mesh_name(r.degrees)}: {r.reason}" for r in rejected]
    return "\n".join(lines)


def to_json(est: MeshEstimate, hw: Hardware, calibration: Calibration | None = None) -> dict:
    out = est.as_dict()
    out["step_time"] = step_time(est, hw, calibration).as_dict()
    out["peak_bytes"] = est.peak_bytes
    out["fits"] = out["peak_bytes"] <= hw.gpu_memory
    out["links"] = links(est, hw)
    out["global_batch"] = est.global_batch
    for stage, s in zip(out["stages"], est.stages):
        if len(s.chunks) == 1:
            stage["blocks"] = s.blocks
        if s.stacks:
            stage["stacks"] = s.stacks
        for what in ("weight", "grad", "optimizer", "state", "activation", "unsharded", "total"):
            stage[f"{what}_bytes"] = getattr(s, f"{what}_bytes")
    return out
