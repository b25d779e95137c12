"""A draft model for speculative decoding made from a GGUF model itself: its first N decoder layers, its
embeddings, final norm and head (an "early exit" copy: same tokenizer, same weights, fewer layers).

There is no smaller model with SmolLM2's tokenizer on this machine (and nothing is downloaded), so the
draft-model figures in docs/engine.md use this copy. Tensors keep their GGUF types (Q4_1 blocks stay
Q4_1); only `<arch>.block_count` changes.

    PYTHONPATH=. .venv/bin/python benchmarks/truncated_draft.py --model builtin:smollm2 --layers 8 \\
        --out /tmp/smollm2-8-layers.gguf
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter

from inflight.checkpoints.resolve import resolve_model

LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")


def truncate(source: Path, num_layers: int, out: Path) -> None:
    reader = GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    block_count = f"{arch}.block_count"
    total = int(reader.fields[block_count].contents())
    if not 0 < num_layers <= total:
        raise SystemExit(f"--layers must be in 1..{total} (the model has {total} layers)")
    writer = GGUFWriter(out, arch)
    for field in reader.fields.values():
        # The writer writes the architecture and the GGUF.* header fields itself.
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = num_layers if field.name == block_count else field.contents()
        kind = field.types[0]
        sub_type = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub_type)
    kept = [t for t in reader.tensors if (m := LAYER_TENSOR.match(t.name)) is None or int(m[1]) < num_layers]
    for tensor in kept:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    print(f"{out}: the first {num_layers} of {total} layers of {source.name}, {len(kept)} tensors")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:smollm2", help="a .gguf file or builtin:NAME")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    parser.add_argument("--out", type=Path, required=True, help="the .gguf file to write")
    args = parser.parse_args()
    truncate(resolve_model(args.model), args.layers, args.out)


if __name__ == "__main__":
    main()
