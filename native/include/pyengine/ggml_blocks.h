// GGUF (ggml) quantized weight blocks, and the tiled layout the CPU kernels repack them into.
//
// GGUF blocks, as written by llama.cpp (ggml-quants.h), one row's k = V b .. V b + V - 1:
//   Q8_0 (32 values, 34 bytes): fp16 d, int8 q[32]                            value = d * q
//   Q4_0 (32, 18): fp16 d, 16 bytes: low nibble of byte i = q[i], high = q[i + 16]   d * (q - 8)
//   Q4_1 (32, 20): fp16 d, fp16 m, 16 nibble bytes as Q4_0                     d * q + m
//   Q5_0 (32, 22): fp16 d, uint32 qh (bit i: q[i]'s fifth bit), nibbles       d * (q - 16)
//   Q5_1 (32, 24): fp16 d, fp16 m, qh, nibbles                                d * q + m
//   Q4_K (256, 144): fp16 d, fp16 dmin, 12 bytes of eight 6-bit (sc, m) pairs, 128 nibble bytes
//        (bytes 32i..32i+31: low nibbles = sub-block 2i, high = 2i + 1)    sub-block s: d sc_s q - dmin m_s
//   Q5_K (256, 176): as Q4_K with 32 bytes qh (bit s of byte l: value l of sub-block s) before the nibbles
//   Q6_K (256, 210): ql[128], qh[64], int8 sc[16] (sub-blocks of 16), fp16 d    d * sc * (q - 32)
//   IQ4_NL (32, 18): as Q4_0                                                    d * kIq4nl[q]
//   IQ4_XS (256, 136): fp16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes: 16 a sub-block of 32 as
//        Q4_0's                               sub-block s: d * (ls_s - 32) * kIq4nl[q], ls 6 bits
//   Q2_K (256, 84): 16 bytes scales (sub-blocks of 16: sc low nibble, m high), qs[64], fp16 d, fp16
//        dmin; value 128 n + 32 i + l is bits 2i, 2i + 1 of qs[32 n + l]   sub-block s: d sc_s q - dmin m_s
//   Q3_K (256, 110): hmask[32], qs[64] (the low 2 bits, as Q2_K's), 12 bytes of sixteen 6-bit scales,
//        fp16 d; value 128 n + 32 i + l's third bit is bit 4n + i of hmask[l]
//                                                       sub-block s: d * (sc_s - 32) * (q - 4), q 3 bits
//
// Tiled layout (linear/quant.cpp): rows in tiles of 16 (zero rows pad the last tile); per (tile, GGUF
// block) one contiguous record, a tile's records after each other, tiles after each other:
//   record = group[V / 32] | scales
//   group (32 values of 16 rows) = quant lines | high lines
//   quant lines: 64 bytes each; line i holds, at byte 4j + t, row j's value for k = 4i + t (Q8_0: 8
//     lines, stored as q + 128: unsigned) or, for the other types (4 lines), k = 8i + t in the low
//     nibble and k = 8i + 4 + t in the high nibble. A line is then exactly the unsigned operand of
//     vpdpbusd against 4 activation bytes broadcast to the 16 lanes, one lane per row.
//     2-bit types (Q2_K, Q3_K: bits = 2): two lines share each byte, so 2 stored lines hold the 4:
//     stored line i / 2 holds line i in bits 4 (i % 2) .. 4 (i % 2) + 3, two 2-bit values (the low one
//     k = 8i + t, the high one k = 8i + 4 + t).
//   high lines: Q5 types (Q3_K) one line, byte 4j + t bit 2i (2i + 1): the fifth (third) bit of line
//     i's low (high) value; Q6_K two lines, line h byte 4j + t bits 4p .. 4p + 3: the top two bits of
//     line 2h + p's low nibble, then of its high nibble.
//   scales, each field an array over the tile's 16 rows:
//     Q8_0, Q4_0, Q5_0: fp16 d[16];  Q4_1, Q5_1: fp16 d[16], fp16 m[16]
//     Q4_K, Q5_K: fp16 d[16], fp16 dmin[16], uint8 sc[8][16], uint8 m[8][16] (the 6-bit pairs unpacked)
//     Q6_K: fp16 d[16], int8 sc[16][16];  IQ4_NL: fp16 d[16];  IQ4_XS: fp16 d[16], int8 ls - 32 [8][16]
//     Q2_K: fp16 d[16], fp16 dmin[16], uint8 scales[16][16] (the GGUF bytes: sc | m << 4);
//     Q3_K: fp16 d[16], int8 sc - 32 [16][16]
// A record holds the GGUF blocks' bits for 16 rows, the K-quants' packed 6-bit scales spread to bytes
// (Q4_K 148, Q5_K 180, IQ4_XS 138, Q3_K 114 bytes a row for 144 / 176 / 136 / 110): resident weights
// stay within 1.04x the file's. The IQ4 types keep their 4-bit table indices; the kernels look the
// values up.
//
// Every 32-value group (or, for Q6_K, Q2_K and Q3_K, each 16-value half) of row j then has a scale d
// and an offset c with value = d * u + c for the stored unsigned value u, so its dot product against
// int8 activations xq (scale dx, s = sum of xq) is  dx * (d * sum(u * xq) + c * s), with
//   c = -128 d (Q8_0), -8 d (Q4_0), -16 d (Q5_0), m (Q4_1, Q5_1), -dmin m_s (Q4_K, Q5_K, Q2_K),
//   -32 d (Q6_K), -4 d (Q3_K)
// and d = d sc_s for the K-quants (Q3_K: d (sc_s - 32)); the IQ4 types' u is kIq4nl[q] + 128
// (c = -128 d), or kIq4nl[q] itself (c = 0) where a path multiplies signed values.
#pragma once

#include <cstdint>

namespace pyengine::ggml {

// GGML type ids (the GGUF tensor type field).
enum Type : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23
};

// The IQ4 types' non-linear 16 levels (llama.cpp's kvalues_iq4nl).
constexpr int8_t kIq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

constexpr int64_t kBlock = 32;  // values per group (and per activation block)
constexpr int64_t kTileRows = 16;

struct Layout {
  int64_t values;       // per GGUF block: 32, or 256 for the K-quants
  int64_t block_bytes;  // of one GGUF block
  int lines;            // quant lines per group: 8 bytes (Q8_0) or 4 nibbles wide
  int high_lines;       // 0, 1 (Q5 types, Q3_K) or 2 (Q6_K)
  int halves;           // scales per group: 2 for 16-value sub-blocks (Q6_K, Q2_K, Q3_K), else 1
  int64_t scale_bytes;  // per record, after its groups
  bool lookup = false;  // 4-bit indices into kIq4nl (the IQ4 types)
  int bits = lines;     // of a value in the quant lines: 8, 4, or 2 (Q2_K, Q3_K: 2 stored lines hold the 4)

  constexpr int64_t groups() const { return values / kBlock; }
  constexpr int64_t group_bytes() const { return 64 * (bits + high_lines); }
  constexpr int64_t scales_offset() const { return groups() * group_bytes(); }
  constexpr int64_t record_bytes() const { return scales_offset() + scale_bytes; }
};

constexpr Layout layout(int type) {
  switch (type) {
    case kQ8_0: return {32, 34, 8, 0, 1, 32};
    case kQ4_0: return {32, 18, 4, 0, 1, 32};
    case kQ4_1: return {32, 20, 4, 0, 1, 64};
    case kQ5_0: return {32, 22, 4, 1, 1, 32};
    case kQ5_1: return {32, 24, 4, 1, 1, 64};
    case kQ4_K: return {256, 144, 4, 0, 1, 320};
    case kQ5_K: return {256, 176, 4, 1, 1, 320};
    case kQ6_K: return {256, 210, 4, 2, 2, 288};
    case kQ2_K: return {256, 84, 4, 0, 2, 320, false, 2};
    case kQ3_K: return {256, 110, 4, 1, 2, 288, false, 2};
    case kIQ4_NL: return {32, 18, 4, 0, 1, 32, true};
    case kIQ4_XS: return {256, 136, 4, 0, 1, 160, true};
    default: return {0, 0, 0, 0, 0, 0};
  }
}

constexpr bool supported(int type) { return layout(type).values != 0; }

}  // namespace pyengine::ggml
