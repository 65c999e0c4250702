"""The dtypes a checkpoint (`CHECKPOINT`) and a safetensors file (`SAFETENSORS_BITS`) hold, by name, torch-free.

The engine binds the checkpoint's names to torch dtypes (`ftsup.trainer.checkpoint.codec.DTYPES`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ftsup.store.errors import CheckpointError

SAFETENSORS_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
"""Bits per value of each safetensors dtype, in the order the format lists them (its writer lays a file's
tensors out by that order, the last first). Sub-byte dtypes (F4, F6_*) pack values into bytes: a tensor's
byte size is its values times its bits over 8, which must come out whole."""


@dataclass(frozen=True)
class CheckpointDType:
    """One dtype a checkpoint can hold."""

    name: str
    """The checkpoint's name (`dcp_metadata.json`, inline rank state): torch's, without `torch.`."""
    itemsize: int
    """Bytes per torch element."""
    safetensors: str | None
    """Its safetensors name; None where safetensors has none (a shard then stores the chunk as raw `U8`
    bytes, and an export refuses it)."""
    packed: int = 1
    """Values per torch element in a safetensors shape: float4_e2m1fn_x2 packs two 4-bit values in one
    byte, and safetensors counts the 4-bit values (its last dimension is twice torch's)."""


def _d(name: str, itemsize: int, st: str | None, packed: int = 1) -> CheckpointDType:
    return CheckpointDType(name, itemsize, st, packed)


CHECKPOINT: tuple[CheckpointDType, ...] = (
    _d("float64", 8, "F64"),
    _d("float32", 4, "F32"),
    _d("float16", 2, "F16"),
    _d("bfloat16", 2, "BF16"),
    _d("int64", 8, "I64"),
    _d("int32", 4, "I32"),
    _d("int16", 2, "I16"),
    _d("int8", 1, "I8"),
    _d("uint64", 8, "U64"),
    _d("uint32", 4, "U32"),
    _d("uint16", 2, "U16"),
    _d("uint8", 1, "U8"),
    _d("bool", 1, "BOOL"),
    _d("complex64", 8, "C64"),
    _d("complex128", 16, None),
    _d("float8_e4m3fn", 1, "F8_E4M3"),
    _d("float8_e4m3fnuz", 1, "F8_E4M3FNUZ"),
    _d("float8_e5m2", 1, "F8_E5M2"),
    _d("float8_e5m2fnuz", 1, "F8_E5M2FNUZ"),
    _d("float8_e8m0fnu", 1, "F8_E8M0"),
    _d("float4_e2m1fn_x2", 1, "F4", packed=2),
)
"""The one dtype table of the project: what save, load, the shard headers and the Hugging Face export
use. Every dtype torch and safetensors both have is here (and complex128, which only the checkpoint
holds); any other dtype (sub-byte ints, quantized, bits) is refused by name."""

BY_NAME: dict[str, CheckpointDType] = {d.name: d for d in CHECKPOINT}
BY_SAFETENSORS: dict[str, CheckpointDType] = {d.safetensors: d for d in CHECKPOINT if d.safetensors is not None}

CAST_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""What `ftsup ckpt export-hf --dtype` (and `--init-from-hf`'s conversion) may convert to."""
CASTABLE: frozenset[str] = frozenset({"float64", "float32", "float16", "bfloat16"})
"""The dtypes a conversion changes: the plain floating types. Integers, bools, complex numbers and the
float8/float4 variants (quantized weights, whose scales live in other tensors) are kept as they are."""


def lookup(name: object, what: str | None = None) -> CheckpointDType:
    """The checkpoint dtype named `name`; CheckpointError (naming `what`, a tensor) for an unknown name."""
    d = BY_NAME.get(name) if isinstance(name, str) else None
    if d is None:
        where = f" for {what}" if what else ""
        raise CheckpointError(f"checkpoint names unknown dtype {name!r:.60}{where}")
    return d
