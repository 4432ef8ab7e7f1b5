"""The prober's raw tracebacks (issue 66 item 8), each now one line in qn_hf's words: a converter asked for 0 ranks,
sequences of no tokens, targets that are not int64."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForQuestionAnswering

from qn_hf import convert
from qn_hf.step.batch import check_model_inputs
from qn_hf.step.loss import LossKind

CONFIG = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)


@pytest.mark.parametrize("flag", ["--tp", "--pp", "--virtual-stages"])
def test_a_conversion_to_no_ranks_is_refused(tmp_path, capsys, flag):
    """``qn-hf-convert from-hf ... --tp 0`` ended in a raw ZeroDivisionError."""
    torch.manual_seed(0)
    LlamaForCausalLM(CONFIG).save_pretrained(tmp_path / "hf")
    degrees = {"--tp": "1", "--pp": "1", flag: "0"}
    capsys.readouterr()  # save_pretrained's progress
    argv = ["from-hf", str(tmp_path / "hf"), str(tmp_path / "out"), *(x for kv in degrees.items() for x in kv)]
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    name = flag[2:].replace("-", "_")
    assert err.startswith(f"qn-hf-convert: error: {name}=0 must be a positive integer"), err
    assert err.count("\n") == 1


def _refusal(batch: dict, model=None, loss=LossKind.CAUSAL_LM) -> str:
    try:
        check_model_inputs(batch, model=model or LlamaForCausalLM(CONFIG), loss=loss)
    except ValueError as e:
        return str(e)
    return "no error"


def test_sequences_of_no_tokens_are_refused():
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert "sequences of no tokens" in _refusal({"input_ids": empty, "labels": empty})
    assert _refusal({"input_ids": torch.ones(2, 1, dtype=torch.long)}) == "no error"


def test_targets_must_be_int64():
    """int32 labels reached torch's cross entropy ("expected target dtype to be Long"), as in the plain model."""
    ids = torch.randint(3, 64, (2, 8))
    assert "pass batch['labels'].long()" in _refusal({"input_ids": ids, "labels": ids.int()})
    assert _refusal({"input_ids": ids.int(), "labels": ids}) == "no error"  # an embedding takes int32 ids
    qa = LlamaForQuestionAnswering(CONFIG)
    spans = {"input_ids": ids, "start_positions": torch.tensor([1, 2], dtype=torch.int32),
             "end_positions": torch.tensor([3, 4])}
    assert "pass batch['start_positions'].long()" in _refusal(spans, model=qa, loss=LossKind.SPANS)


def test_a_dcp_without_checksums_is_said_so_and_verified_on_request(tmp_path, capsys):
    """A torch-written DCP with one flipped data byte converted with exit 0 and no word: the converter now says the
    format has no checksums, and --verify-against compares the result with a copy the user trusts."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    model.save_pretrained(tmp_path / "hf")
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    capsys.readouterr()
    argv = ["to-hf", str(tmp_path / "dcp"), str(tmp_path / "out"), "--config", str(tmp_path / "hf")]
    assert convert.main([*argv, "--verify-against", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert "without checksums" in err and f"verified: {len(model.state_dict())} tensors equal" in err, err
    data = next(p for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    argv[2] = str(tmp_path / "damaged")
    assert convert.main(argv) == 0  # nothing in the format to catch it: the note says so
    assert "a damaged byte would convert unnoticed; to-hf --verify-against" in capsys.readouterr().err
    argv[2] = str(tmp_path / "checked")
    assert convert.main([*argv, "--verify-against", str(tmp_path / "hf")]) == 2
    assert "differs from" in capsys.readouterr().err
