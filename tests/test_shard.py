"""ShardSpec slicing and reassembly, without processes."""

import pytest
import torch

from qn_hf.tensor_parallel.shard import ShardSpec, padded


def roundtrip(spec: ShardSpec, full: torch.Tensor) -> list[torch.Tensor]:
    shards = [spec.shard(full, r) for r in range(spec.tp)]
    assert torch.equal(spec.unshard(shards), full)
    return shards


def test_plain_split_on_either_dim():
    full = torch.arange(24.0).view(4, 6)
    shards = roundtrip(ShardSpec(dim=1, tp=3, size=6), full)
    assert torch.equal(shards[1], full[:, 2:4])
    shards = roundtrip(ShardSpec(dim=0, tp=2, size=4), full)
    assert torch.equal(shards[1], full[2:])


def test_packed_qkv_keeps_each_part_split():
    q, k, v = (torch.full((2, 4), float(i)) + torch.arange(4.0) for i in range(3))
    full = torch.cat([q, k, v], dim=1)  # Conv1D layout [in, 3*out]
    shards = roundtrip(ShardSpec(dim=1, tp=2, size=12, parts=3), full)
    assert torch.equal(shards[1], torch.cat([q[:, 2:], k[:, 2:], v[:, 2:]], dim=1))


def test_kv_replicas_hold_the_same_heads():
    full = torch.arange(8.0).view(8, 1)  # 2 KV heads of dim 4
    spec = ShardSpec(dim=0, tp=4, size=8, replicas=2)
    shards = roundtrip(spec, full)
    assert torch.equal(shards[0], shards[1]) and torch.equal(shards[2], shards[3])
    assert torch.equal(shards[2], full[4:])
    assert spec.norm_weight() == 0.5


def test_vocab_padding_zero_rows_and_ranges():
    full = torch.randn(99, 3)
    spec = ShardSpec(dim=0, tp=4, size=99, padded_size=padded(99, 4))
    shards = roundtrip(spec, full)
    assert spec.local_range(3) == (75, 100)
    assert torch.equal(shards[3][-1], torch.zeros(3))


def test_bad_specs_are_rejected():
    with pytest.raises(ValueError, match="replicas=3 must divide tp=4"):
        ShardSpec(dim=0, tp=4, size=8, replicas=3)
    with pytest.raises(ValueError, match="not divisible"):
        ShardSpec(dim=0, tp=4, size=6)
    with pytest.raises(ValueError, match="expected size 8"):
        ShardSpec(dim=0, tp=2, size=8).shard(torch.zeros(6), 0)


def test_pieces_tile_the_unpadded_tensor():
    cases = [
        ShardSpec(dim=1, tp=2, size=12, parts=3),
        ShardSpec(dim=0, tp=4, size=8, replicas=2),
        ShardSpec(dim=0, tp=4, size=99, padded_size=padded(99, 4)),
        ShardSpec(dim=0, tp=1, size=5),
    ]
    for spec in cases:
        full = torch.arange(float(spec.size * 2)).view(spec.size, 2) if spec.dim == 0 else torch.arange(float(spec.size * 2)).view(2, spec.size)
        covered = []
        for rank in range(spec.tp):
            local = spec.shard(full, rank)
            for start, stop, at in spec.pieces(rank):
                assert torch.equal(local.narrow(spec.dim, at, stop - start), full.narrow(spec.dim, start, stop - start))
                if spec.writes(rank):
                    covered += range(start, stop)
        assert sorted(covered) == list(range(spec.size))
