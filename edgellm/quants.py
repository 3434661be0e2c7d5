"""Quant-type registry: one entry per GGML tensor type edgellm supports.

Each entry says how many weights a block holds, how many bytes it takes (written as the sum of its
fields, in the order they sit in memory) and how its bits are laid out. The NumPy reference
dequantizer is `gguf.quants.dequantize`, which the gguf package tests bit-exact against ggml; the
fast kernels (edgellm.kernels.cpu / .cuda) are tested against it.

A row of a 2-D GGUF tensor with ne = [n_cols, n_rows] is n_cols // block_size consecutive blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

QK = 32  # weights per block, legacy types
QK_K = 256  # weights per super-block, K-quants and IQ4_XS
# the 16 signed values a 4-bit IQ4_NL / IQ4_XS code stands for (ggml's kvalues_iq4nl)
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(frozen=True)
class QuantType:
    ggml_type: GGMLType
    block_size: int  # weights per block
    type_size: int  # bytes per block
    layout: str  # bit layout, for humans

    @property
    def name(self) -> str:
        return self.ggml_type.name

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def row_bytes(self, n_cols: int) -> int:
        return n_cols // self.block_size * self.type_size

    def dequantize_reference(self, raw: np.ndarray) -> np.ndarray:
        """uint8 (..., n_blocks * type_size) -> float32 (..., n_blocks * block_size)."""
        from gguf.quants import dequantize

        return np.asarray(dequantize(np.asarray(raw, dtype=np.uint8), self.ggml_type), dtype=np.float32)


_TYPES = [
    QuantType(GGMLType.F32, 1, 4, "f32"),
    QuantType(GGMLType.F16, 1, 2, "f16"),
    QuantType(GGMLType.BF16, 1, 2, "bf16: the top 16 bits of an f32"),
    # d: f16 scale | qs[16]: 32 nibbles, low nibbles = weights 0..15, high nibbles = 16..31
    # w = d * (q - 8)
    QuantType(GGMLType.Q4_0, QK, 2 + QK // 2, "d:f16 | qs:u8[16] (lo nibble j, hi nibble j+16); w = d*(q-8)"),
    # d, m: f16 | qs[16] as Q4_0;  w = d*q + m
    QuantType(GGMLType.Q4_1, QK, 2 + 2 + QK // 2, "d:f16 m:f16 | qs:u8[16]; w = d*q + m"),
    # d: f16 | qh: u32, bit j = 5th bit of weight j | qs[16] low nibbles as Q4_0;  w = d*(q - 16)
    QuantType(GGMLType.Q5_0, QK, 2 + 4 + QK // 2, "d:f16 | qh:u32 | qs:u8[16]; w = d*(q-16)"),
    # d, m: f16 | qh: u32 | qs[16];  w = d*q + m
    QuantType(GGMLType.Q5_1, QK, 2 + 2 + 4 + QK // 2, "d:f16 m:f16 | qh:u32 | qs:u8[16]; w = d*q + m"),
    # d: f16 | qs: i8[32];  w = d*q
    QuantType(GGMLType.Q8_0, QK, 2 + QK, "d:f16 | qs:i8[32]; w = d*q"),
    # scales[16]: lo nibble = scale, hi nibble = min of each 16-weight group | qs[64]: 2-bit weights
    # | d, dmin: f16;  w = d*sc*q - dmin*m
    QuantType(GGMLType.Q2_K, QK_K, QK_K // 16 + QK_K // 4 + 2 + 2,
              "scales:u8[16] | qs:u8[64] (2-bit) | d:f16 dmin:f16; w = d*sc*q - dmin*m"),
    # hmask[32]: high bit of each weight | qs[64]: low 2 bits | scales[12]: 16 6-bit scales | d: f16
    # w = d*(sc-32)*(q - (hbit ? 0 : 4))
    QuantType(GGMLType.Q3_K, QK_K, QK_K // 8 + QK_K // 4 + 12 + 2,
              "hmask:u8[32] | qs:u8[64] | scales:u8[12] (6-bit x16) | d:f16; w = d*(sc-32)*(q-4*!h)"),
    # d, dmin: f16 | scales[12]: 8 6-bit scales + 8 6-bit mins | qs[128]: 4-bit weights
    # w = d*sc*q - dmin*m, per 32-weight sub-block
    QuantType(GGMLType.Q4_K, QK_K, 2 + 2 + 12 + QK_K // 2,
              "d:f16 dmin:f16 | scales:u8[12] (6-bit sc,m x8) | qs:u8[128]; w = d*sc*q - dmin*m"),
    # d, dmin: f16 | scales[12] | qh[32]: 5th bits | qs[128]: low 4 bits
    QuantType(GGMLType.Q5_K, QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2,
              "d:f16 dmin:f16 | scales:u8[12] | qh:u8[32] | qs:u8[128]; w = d*sc*q - dmin*m"),
    # ql[128]: low 4 bits | qh[64]: high 2 bits | scales: i8[16] | d: f16;  w = d*sc*(q - 32)
    QuantType(GGMLType.Q6_K, QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2,
              "ql:u8[128] | qh:u8[64] | scales:i8[16] | d:f16; w = d*sc*(q-32)"),
    # d: f16 | qs[16] nibbles as Q4_0;  w = d * KVALUES_IQ4NL[q]
    QuantType(GGMLType.IQ4_NL, QK, 2 + QK // 2, "d:f16 | qs:u8[16] (lo nibble j, hi nibble j+16); w = d*kv[q]"),
    # d: f16 | scales_h: u16, 2 high bits per sub-block | scales_l[4]: 4 low bits per sub-block |
    # qs[128]: 16 bytes per 32-weight sub-block s as IQ4_NL;  ls = 6-bit scale;  w = d*(ls-32)*kv[q]
    QuantType(GGMLType.IQ4_XS, QK_K, 2 + 2 + QK_K // 64 + QK_K // 2,
              "d:f16 | scales_h:u16 | scales_l:u8[4] | qs:u8[128]; w = d*(ls-32)*kv[q] per 32"),
    # the grid types: d: f16 | per 32 weights, grid entries (8 values for IQ2, 4 for IQ3), a sign per
    # weight and a 4-bit scale ls (per 16 for IQ2_XS / IQ2_S);  w = d*(0.5+ls)/4 * grid * sign (IQ2),
    # d*(0.5+ls)/2 * grid * sign (IQ3_XXS), d*(1+2 ls) * grid * sign (IQ3_S)
    QuantType(GGMLType.IQ2_XXS, QK_K, 2 + QK_K // 4,
              "d:f16 | qs:u32[16] (per 32: 4 grid bytes | 4x7 sign bits, ls:4)"),
    QuantType(GGMLType.IQ2_XS, QK_K, 2 + QK_K // 4 + QK_K // 32,
              "d:f16 | qs:u16[32] (9-bit grid | 7 sign bits) | scales:u8[8] (ls per 16)"),
    QuantType(GGMLType.IQ2_S, QK_K, 2 + QK_K // 4 + QK_K // 16,
              "d:f16 | qs:u8[32] | signs:u8[32] | qh:u8[8] (grid bits 8-9) | scales:u8[8] (ls per 16)"),
    QuantType(GGMLType.IQ3_XXS, QK_K, 2 + 3 * QK_K // 8,
              "d:f16 | qs:u8[64] (grid) | u32[8] (per 32: 4x7 sign bits, ls:4)"),
    QuantType(GGMLType.IQ3_S, QK_K, 2 + QK_K // 4 + QK_K // 32 + QK_K // 8 + QK_K // 64,
              "d:f16 | qs:u8[64] | qh:u8[8] (grid bit 8) | signs:u8[32] | scales:u8[4] (ls per 32)"),
    # ternary: codes q in 0..2, w = d * (q - 1); TQ1_0 packs 5 base-3 digits per byte (4 in qh)
    QuantType(GGMLType.TQ1_0, QK_K, (QK_K - 4 * QK_K // 64) // 5 + QK_K // 64 + 2,
              "qs:u8[48] (5 digits each) | qh:u8[4] (4 digits) | d:f16; w = d*(q-1)"),
    QuantType(GGMLType.TQ2_0, QK_K, QK_K // 4 + 2, "qs:u8[64] (2-bit codes) | d:f16; w = d*(q-1)"),
    # 1.5-1.75 bits: 8-value grid entries of -1/0/1, a 3-bit scale and a delta of +-1/8;
    # w = d*(2 ls + 1) * (grid + delta)
    QuantType(GGMLType.IQ1_S, QK_K, 2 + QK_K // 8 + QK_K // 16,
              "d:f16 | qs:u8[32] | qh:u16[8] (per 32: 4x3 grid bits, ls:3, delta sign)"),
    QuantType(GGMLType.IQ1_M, QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32,
              "qs:u8[32] | qh:u8[16] (per 8: 3 grid bits, delta sign) | scales:u16[4] (ls per 16, d's 4 bits each)"),
]

QUANT_TYPES: dict[GGMLType, QuantType] = {t.ggml_type: t for t in _TYPES}
# types the CPU backend runs and the CUDA backend does not yet: the planner keeps them off the GPU
CPU_ONLY_TYPES = frozenset((GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.IQ2_XXS, GGMLType.IQ2_XS,
                            GGMLType.IQ2_S, GGMLType.IQ3_XXS, GGMLType.IQ3_S, GGMLType.TQ1_0, GGMLType.TQ2_0,
                            GGMLType.IQ1_S, GGMLType.IQ1_M))
SUPPORTED_TYPE_NAMES = ", ".join(t.name for t in _TYPES)


def quant_type(ggml_type: int | GGMLType) -> QuantType:
    """The registry entry for a GGML type id; raises UnsupportedTensorTypeError otherwise."""
    from edgellm.errors import UnsupportedTensorTypeError

    try:
        return QUANT_TYPES[GGMLType(int(ggml_type))]
    except (ValueError, KeyError):
        try:
            name = GGMLType(int(ggml_type)).name
        except ValueError:
            name = f"unknown type id {int(ggml_type)}"
        raise UnsupportedTensorTypeError(
            f"tensor type {name} is not supported; supported: {SUPPORTED_TYPE_NAMES}"
        ) from None


def _check_sizes() -> None:
    from gguf import GGML_QUANT_SIZES

    for t in _TYPES:
        assert GGML_QUANT_SIZES[t.ggml_type] == (t.block_size, t.type_size), t.name


_check_sizes()
