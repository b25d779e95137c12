"""A Q8_0 (or BF16, or F32) GGUF made from the weights of another GGUF file (#30: the quality check's second
file; #29: BF16 and F32 files for the batch-1 comparison with llama-server on float weights).

Every quantized tensor of the source is dequantized to float32 and quantized to Q8_0 (32-weight blocks,
one float16 scale = max|w|/127, llama.cpp's reference rounding) with the `gguf` package; float32/float16
tensors (the norms) and all metadata are copied, general.file_type becomes MOSTLY_Q8_0. The source's
dequantized values are the only weights the file has, so the Q8_0 file holds the same weights at 8 bits
(each Q4_1 block's 16 levels land within half an 8-bit step), not the original bfloat16 checkpoint's.

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_q8_0.py SOURCE.gguf OUT.gguf [--type bf16|f32]

With `--type bf16` the quantized tensors are dequantized to float32 and rounded to bfloat16 instead
(general.file_type MOSTLY_BF16); with `--type f32` they are written as the float32 values (ALL_F32).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

KEPT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
# --type: the tensor type written and the file type it makes.
TARGETS = {
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
}


def converted_tensor(
    data: np.ndarray, qtype: GGMLQuantizationType, target: GGMLQuantizationType = GGMLQuantizationType.Q8_0
) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A tensor's data as written to the new file: kept when unquantized, else requantized to `target`."""
    if qtype in KEPT_TYPES:
        return np.array(data), qtype
    return quantize(dequantize(data, qtype), target), target


def write_q8_0(source: Path, out: Path, target: str = "q8_0") -> None:
    tensor_type, file_type = TARGETS[target]
    reader = GGUFReader(source)
    architecture = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(out, architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue  # the header's own fields and the architecture: GGUFWriter writes them
        value = file_type if name == "general.file_type" else field.contents()
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        data, qtype = converted_tensor(tensor.data, tensor.tensor_type, tensor_type)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", choices=tuple(TARGETS), default="q8_0")
    args = parser.parse_args()
    write_q8_0(args.source, args.out, args.type)
    print(args.out)


if __name__ == "__main__":
    main()
