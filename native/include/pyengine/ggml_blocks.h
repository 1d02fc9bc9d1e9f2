// GGUF (ggml) quantized weight blocks, and the tiled layout the CPU kernels repack them into.
//
// GGUF blocks of 32 values (one row's k = 32b .. 32b + 31), as written by llama.cpp:
//   Q8_0 (34 bytes): fp16 d, int8 q[32]                                   value = d * q
//   Q4_0 (18 bytes): fp16 d, 16 bytes: low nibble of byte i = q[i], high = q[i + 16]   value = d * (q - 8)
//   Q4_1 (20 bytes): fp16 d, fp16 m, 16 nibble bytes as Q4_0              value = d * q + m
//
// Tiled layout (qlinear.cpp): rows in tiles of 16 (zero rows pad the last tile), and per
// (tile, block) one contiguous record, tiles after each other:
//   record = quants | d[16] fp16 | (Q4_1) m[16] fp16
//   quants: 64-byte lines; line i holds, at byte 4j + t, row j's value for k = 4i + t (Q8_0, 8 lines,
//   stored as q + 128: unsigned) or, for the 4-bit types (4 lines), k = 8i + t in the low nibble and
//   k = 8i + 4 + t in the high nibble. A line is then exactly the unsigned operand of vpdpbusd
//   against 4 activation bytes broadcast to the 16 lanes, one lane per row.
// The record has the GGUF block's bytes for 16 rows (Q8_0 34, Q4_0 18, Q4_1 20 bytes a row), so
// the resident weights are the file's tensor bytes plus at most 15 padding rows.
//
// Every type's block dot product against int8 activations xq (scale dx, s = sum of xq) is then
//   dx * (d * sum(u * xq) + c * s)   with u the stored unsigned value and
//   c = -128 d (Q8_0), -8 d (Q4_0), m (Q4_1).
#pragma once

#include <cstdint>

namespace pyengine::ggml {

// GGML type ids (the GGUF tensor type field).
enum Type : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

constexpr int64_t kBlock = 32;  // values per block
constexpr int64_t kTileRows = 16;

constexpr bool supported(int type) { return type == kQ4_0 || type == kQ4_1 || type == kQ8_0; }

// Bytes of one GGUF block.
constexpr int64_t block_bytes(int type) { return type == kQ8_0 ? 34 : type == kQ4_0 ? 18 : 20; }

// Bytes of quants in one (tile, block) record.
constexpr int64_t record_quant_bytes(int type) { return type == kQ8_0 ? 512 : 256; }

// Bytes of one (tile, block) record: 16 rows' blocks.
constexpr int64_t record_bytes(int type) { return kTileRows * block_bytes(type); }

}  // namespace pyengine::ggml
