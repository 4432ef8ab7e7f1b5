"""Property-based tests of the checkpoint index parser: whatever bytes or JSON an index holds,
``read_index`` returns a validated index or raises ``CheckpointError`` (never another exception,
never an unbounded allocation), every index it accepts tiles each tensor exactly once with file
names inside the checkpoint directory, and any edited byte of a sealed index is refused."""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qn_hf.checkpoint import FORMAT, INDEX, VERSION, CheckpointError, read_index
from qn_hf.checkpoint.seal import seal

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=25,
)
files = st.sampled_from(["model.safetensors", "a-00001.safetensors", "../escape.safetensors", "/etc/passwd",
                         "sub/x.safetensors", "", ".", "..", "notes.txt", 3, None])
dims = st.integers(min_value=-1, max_value=5) | st.sampled_from([2**41, 2**20])
boxes = st.lists(st.lists(st.integers(min_value=-1, max_value=6), min_size=2, max_size=2), max_size=3)
pieces = st.lists(st.fixed_dictionaries({"file": files, "key": st.sampled_from(["t", "u", 7]), "box": boxes}), max_size=5)
entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(["float32", "bfloat16", "int64", "F32", "float8", "object", None]),
    "shape": st.lists(dims, max_size=3),
    "pieces": pieces,
})


def _write(directory: str, payload: bytes) -> None:
    with open(os.path.join(directory, INDEX), "wb") as f:
        f.write(payload)


def _index(tensors) -> dict:
    """A sealed index over ``tensors``, with a digest for every file their pieces name (large enough
    records: the checks of what the pieces need come after)."""
    names = {p.get("file") for e in tensors.values() if isinstance(e, dict) and isinstance(e.get("pieces"), list)
             for p in e["pieces"] if isinstance(p, dict)}
    files = {f: {"bytes": 1 << 50, "crc32": 0} for f in names if isinstance(f, str) and os.path.basename(f) == f}
    return {"format": FORMAT, "version": VERSION, "step": 1, "config": {"model_type": "gpt2"}, "tensors": tensors,
            "files": files}


@SETTINGS
@given(value=json_values)
def test_any_json_is_refused_cleanly_or_valid(value):
    with tempfile.TemporaryDirectory() as d:
        _write(d, json.dumps(value).encode())
        with pytest.raises(CheckpointError):
            read_index(d)  # arbitrary JSON is never a qn_hf index (format and version are required)


@SETTINGS
@given(payload=st.binary(max_size=200) | st.sampled_from([b"[" * 100_000, b'{"a": ' * 50_000, b"\xff\xfe\x00"]))
def test_bytes_that_are_not_json_are_refused(payload):
    with tempfile.TemporaryDirectory() as d:
        _write(d, payload)
        with pytest.raises(CheckpointError):
            read_index(d)


@SETTINGS
@given(tensors=st.dictionaries(st.sampled_from(["w", "b", "model.x"]), entries, min_size=1, max_size=3))
def test_an_accepted_index_tiles_every_tensor_exactly_once(tensors):
    with tempfile.TemporaryDirectory() as d:
        _write(d, seal(_index(tensors)))
        try:
            index = read_index(d)
        except CheckpointError:
            return
        for name, entry in index["tensors"].items():
            shape = entry["shape"]
            assert all(isinstance(n, int) and n >= 0 for n in shape)
            assert int(np.prod(shape, dtype=object)) <= 2**40
            for piece in entry["pieces"]:
                assert os.path.basename(piece["file"]) == piece["file"] and piece["file"].endswith(".safetensors")
            if int(np.prod(shape, dtype=object)) <= 4096:
                cover = np.zeros(shape, dtype=np.int64)
                for piece in entry["pieces"]:
                    cover[tuple(slice(a, b) for a, b in piece["box"])] += 1
                assert (cover == 1).all(), (name, entry)


def test_huge_index_file_is_refused_before_reading(tmp_path):
    with open(tmp_path / INDEX, "wb") as f:
        f.truncate(300 << 20)  # sparse: no disk used
    with pytest.raises(CheckpointError, match="more than an index can be"):
        read_index(str(tmp_path))


@st.composite
def tilings(draw):
    """A shape and boxes that split it along dim 0, then maybe one mutation (drop, duplicate, shift)."""
    shape = draw(st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=3))
    cuts = sorted(set(draw(st.lists(st.integers(min_value=1, max_value=shape[0] - 1), max_size=3)) if shape[0] > 1 else []))
    edges = [0, *cuts, shape[0]]
    boxes = [[[a, b], *[[0, n] for n in shape[1:]]] for a, b in zip(edges, edges[1:])]
    mutation = draw(st.sampled_from(["none", "drop", "duplicate", "shift"]))
    if mutation == "drop" and len(boxes) > 1:
        boxes.pop(draw(st.integers(min_value=0, max_value=len(boxes) - 1)))
    elif mutation == "duplicate":
        boxes.append(boxes[0])
    elif mutation == "shift" and boxes[0][0][1] < shape[0]:
        boxes[0] = [[boxes[0][0][0], boxes[0][0][1] + 1], *boxes[0][1:]]
    return shape, boxes


@SETTINGS
@given(case=tilings())
def test_accepted_exactly_when_the_pieces_tile(case):
    shape, boxes = case
    cover = np.zeros(shape, dtype=np.int64)
    for box in boxes:
        cover[tuple(slice(a, b) for a, b in box)] += 1
    entry = {"dtype": "float32", "shape": shape,
             "pieces": [{"file": f"p{i}.safetensors", "key": "t", "box": box} for i, box in enumerate(boxes)]}
    with tempfile.TemporaryDirectory() as d:
        _write(d, seal(_index({"t": entry})))
        if (cover == 1).all():
            assert read_index(d)["tensors"]["t"]["shape"] == shape
        else:
            with pytest.raises(CheckpointError, match="overlap|cover"):
                read_index(d)


@st.composite
def boxes_in(draw):
    """A shape of up to three dimensions and up to six boxes inside it, anywhere (most do not tile)."""
    shape = draw(st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=3))
    out = []
    for _ in range(draw(st.integers(min_value=1, max_value=6))):
        box = []
        for n in shape:
            a = draw(st.integers(min_value=0, max_value=n))
            box.append([a, draw(st.integers(min_value=a, max_value=n))])
        out.append(box)
    return shape, out


@SETTINGS
@given(case=boxes_in() | tilings())
@example(case=([2, 2], [[[0, 2], [0, 1]], [[0, 1], [0, 2]]]))  # as many elements as the shape: one twice, one never
@example(case=([3, 2, 2], [[[0, 3], [0, 2], [0, 1]], [[0, 2], [0, 2], [1, 2]], [[2, 3], [0, 2], [1, 2]]]))  # a tiling
def test_multi_dimensional_pieces_are_accepted_exactly_when_they_tile(case):
    """The linear-time tiling check (signed corners) agrees with counting every element's cover."""
    shape, boxes = case
    cover = np.zeros(shape, dtype=np.int64)
    for box in boxes:
        cover[tuple(slice(a, b) for a, b in box)] += 1
    entry = {"dtype": "uint8", "shape": shape,
             "pieces": [{"file": f"p{i}.safetensors", "key": "t", "box": box} for i, box in enumerate(boxes)]}
    with tempfile.TemporaryDirectory() as d:
        _write(d, seal(_index({"t": entry})))
        if (cover == 1).all():
            assert read_index(d)["tensors"]["t"]["shape"] == shape
        else:
            with pytest.raises(CheckpointError, match="overlap|cover"):
                read_index(d)


SEALED = seal(_index({"model.w": {"dtype": "float32", "shape": [4, 2], "pieces": [
    {"file": "a.safetensors", "key": "w#0", "box": [[0, 2], [0, 2]]},
    {"file": "b.safetensors", "key": "w#1", "box": [[2, 4], [0, 2]]}]}}) | {"optimizer": [
        {"lr": 1e-05, "betas": [0.9, 0.999], "params": ["model.w"]}], "loss_scaler": None})


@SETTINGS
@given(at=st.integers(min_value=0, max_value=len(SEALED) - 1), value=st.integers(min_value=0, max_value=255))
@example(at=SEALED.index(b"1e-05") + 1, value=ord("E"))  # parses to the same value: only a digest of bytes sees it
@example(at=SEALED.index(b'"version": 2') + 11, value=ord("1"))  # an older version must not skip the check
@example(at=SEALED.index(b"0.999") + 3, value=ord("1"))
def test_any_edited_byte_of_a_sealed_index_is_refused(at, value):
    if SEALED[at] == value:
        return
    with tempfile.TemporaryDirectory() as d:
        _write(d, SEALED)
        assert read_index(d)["optimizer"][0]["betas"] == [0.9, 0.999]
        _write(d, SEALED[:at] + bytes([value]) + SEALED[at + 1:])
        with pytest.raises(CheckpointError):
            read_index(d)
