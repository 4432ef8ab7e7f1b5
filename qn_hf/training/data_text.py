"""Language-model data through ``datasets``: local text/parquet/json files, tokenized and cut into
blocks of ``seq_len`` tokens; the last ``val_fraction`` of the blocks is the validation split.

Tokenizer: ``--tokenizer DIR``, else the model directory's own tokenizer, else UTF-8 bytes
(vocabulary 257, 256 = end of document), which needs no files and suits the tiny presets. The
offline default corpus is Python's reference manual, which every CPython ships as
``pydoc_data.topics`` (about 460 KB of English text).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Any

from datasets import Dataset, load_dataset

from ..arguments import plural
from .data_files import builder_for, resolve_files
from .errors import UsageError

TEXT_EXTENSIONS = (".txt", ".text", ".md", ".parquet", ".json", ".jsonl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@dataclass(frozen=True)
class LmData:
    train: Dataset  # column input_ids: seq_len tokens per row, torch format
    val: Dataset
    vocab_size: int
    eos_token_id: int | None
    tokenizer: str  # "utf-8 bytes" or the tokenizer directory
    source: str


class ByteTokenizer:
    vocab_size = 257
    eos_token_id = 256

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) + [self.eos_token_id] for t in texts]


class HfTokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot load a tokenizer from {path}: {e}") from None
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        eos = [] if self.eos_token_id is None else [self.eos_token_id]
        return [row + eos for row in ids]


def tokenizer_source(*, tokenizer: str | None, model_dir: str | None) -> str | None:
    """The directory to load a tokenizer from, or None for UTF-8 bytes."""
    if tokenizer is not None:
        if not os.path.isdir(tokenizer):
            raise UsageError(f"tokenizer directory {tokenizer} does not exist")
        return tokenizer
    if model_dir is not None and any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        return model_dir
    return None


def check_text_files(data: tuple[str, ...]) -> list[str]:
    files = resolve_files(data, extensions=TEXT_EXTENSIONS)
    builder_for(files)
    return files


def load_lm_data(*, data: tuple[str, ...], text_column: str, seq_len: int, val_fraction: float,
                 tokenizer_dir: str | None) -> LmData:
    tokenizer: Any = HfTokenizer(tokenizer_dir) if tokenizer_dir else ByteTokenizer()
    raw, column, source = _raw_documents(data, text_column)

    def encode(rows: dict[str, list]) -> dict[str, list]:
        return {"ids": tokenizer.encode_documents([t for t in rows[column] if t])}

    def blocks(rows: dict[str, list]) -> dict[str, list]:
        # Concatenate documents (each ends with EOS) and cut into full blocks; the tail of each
        # map batch (<seq_len tokens per 1000 documents) is dropped.
        flat = [t for row in rows["ids"] for t in row]
        n = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i : i + seq_len] for i in range(0, n, seq_len)]}

    ids = raw.map(encode, batched=True, remove_columns=raw.column_names, desc="tokenizing")
    grouped = ids.map(blocks, batched=True, batch_size=1000, remove_columns=["ids"], desc=f"blocks of {seq_len}")
    n_val = max(1, round(len(grouped) * val_fraction))
    if len(grouped) - n_val < 1:
        raise UsageError(f"the corpus gives only {plural(len(grouped), 'block')} of {seq_len} tokens; use more data or a smaller --seq-len")
    train = grouped.select(range(len(grouped) - n_val)).with_format("torch")
    val = grouped.select(range(len(grouped) - n_val, len(grouped))).with_format("torch")
    return LmData(train=train, val=val, vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id,
                  tokenizer=tokenizer_dir or "utf-8 bytes", source=source)


def _raw_documents(data: tuple[str, ...], text_column: str) -> tuple[Dataset, str, str]:
    if not data:
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        texts = [topics[k] for k in sorted(topics)]
        return Dataset.from_dict({"text": texts}), "text", f"Python {platform.python_version()} reference manual (pydoc_data.topics)"
    files = check_text_files(data)
    builder = builder_for(files)
    options = {"sample_by": "document", "keep_linebreaks": True} if builder == "text" else {}
    raw = load_dataset(builder, data_files=files, split="train", **options)
    column = "text" if builder == "text" else text_column
    if column not in raw.column_names:
        raise UsageError(f"the {builder} data has no column {column!r} (has {raw.column_names}); pass --text-column")
    return raw, column, f"{len(files)} {builder} file(s) ({files[0]}{', ...' if len(files) > 1 else ''})"
