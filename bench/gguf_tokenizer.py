"""A Hugging Face tokenizer for the engines' model, built offline from the GGUF's own vocabulary
and merges, and placed as a local Hugging Face cache snapshot, for a load generator that loads
its tokenizer by name (aiperf) on a machine without access to the Hub.

    python -m bench.gguf_tokenizer --hf-home /tmp/hf [--name HuggingFaceTB/SmolLM2-135M-Instruct]

Then `HF_HOME=/tmp/hf HF_HUB_OFFLINE=1` and the name load it (transformers' AutoTokenizer). The
GGUF (irislab.engines.model_path) carries `tokenizer.ggml.model` "gpt2" (byte-level BPE),
`tokenizer.ggml.tokens`, `tokenizer.ggml.merges` and the special token ids; the tokenizer is
rebuilt from them with the `tokenizers` package, so it counts tokens as the engine does (the
chat template aside). Needs the `gguf` and `tokenizers` packages (not dependencies of this
project: install them beside the load generator). Raises ValueError for a GGUF whose tokenizer
is not byte-level BPE.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SNAPSHOT = "0" * 40  # the snapshot's "commit": any 40 hex digits that refs/main names


def _field(reader, name: str):
    field = reader.fields[name]
    if len(field.data) == 1:
        value = field.parts[field.data[0]]
        return bytes(value).decode() if value.dtype.kind == "u" and value.dtype.itemsize == 1 else value[0].item()
    return [bytes(field.parts[i]).decode() for i in field.data]


def build(gguf_path: Path, hf_home: Path, name: str) -> Path:
    """Write the tokenizer of `gguf_path` as snapshot of model `name` under `hf_home`; returns
    the snapshot folder (tokenizer.json, tokenizer_config.json, config.json)."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    reader = gguf.GGUFReader(str(gguf_path))
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{gguf_path}: tokenizer {kind!r}, not byte-level BPE (gpt2)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges")]
    bos = tokens[int(_field(reader, "tokenizer.ggml.bos_token_id"))]
    eos = tokens[int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    folder = hf_home / "hub" / f"models--{name.replace('/', '--')}"
    snapshot = folder / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(SNAPSHOT)
    tokenizer.save(str(snapshot / "tokenizer.json"))
    (snapshot / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "model_max_length": 8192}))
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": len(tokens)}))
    return snapshot


def main(argv: list[str] | None = None) -> None:
    from irislab.engines import model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-home", type=Path, required=True)
    parser.add_argument("--name", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--gguf", type=Path, default=None, help="default: the engines' model (irislab.engines)")
    args = parser.parse_args(argv)
    print(build(args.gguf or model_path(), args.hf_home, args.name))


if __name__ == "__main__":
    main()
