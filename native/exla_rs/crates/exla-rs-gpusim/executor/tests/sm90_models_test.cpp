// Tests of executor/sm90_models.{hpp,cpp} from first principles: operands are placed in shared
// memory by this file's own formulas, written from the PTX ISA / driver text (not through the
// model's address helpers), results compared with a float64 matmul.
//   run: executor/tests/run_sm90_models_test.sh
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <random>
#include <vector>

#include "../exec.h"
#include "../runtime.hpp"
#include "../sm90_models.hpp"

using namespace exla_rs_gpusim::sm90;

// The models report the global bytes a TMA copy reads to the runtime's traffic statistics
// (runtime.cpp); this test links the models alone, so the report goes nowhere.
namespace exla_rs_gpusim {
void global_access(const void*, size_t, Global) {}
}  // namespace exla_rs_gpusim

static int g_failures = 0;
static int g_checks = 0;
#define CHECK(cond, ...)                                         \
  do {                                                           \
    ++g_checks;                                                  \
    if (!(cond)) {                                               \
      ++g_failures;                                              \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                              \
      fprintf(stderr, "\n");                                     \
    }                                                            \
  } while (0)

// Host buffers with the alignment the driver/ISA demand, sized exactly (ASan sees overruns).
struct Aligned {
  uint8_t* p = nullptr;
  size_t n = 0;
  Aligned(size_t bytes, size_t align) : n(bytes) { p = static_cast<uint8_t*>(aligned_alloc(align, (bytes + align - 1) / align * align)); }
  ~Aligned() { free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
};

static uint16_t enc(bool bf16, float f) { return bf16 ? float_to_bf16(f) : float_to_f16(f); }
static float dec(bool bf16, uint16_t h) { return bf16 ? bf16_to_float(h) : f16_to_float(h); }
static void put16(uint8_t* smem, uint32_t addr, uint16_t v) { memcpy(smem + addr, &v, 2); }
static uint16_t get16(const uint8_t* smem, uint32_t addr) {
  uint16_t v;
  memcpy(&v, smem + addr, 2);
  return v;
}

// ------------------------------------------------------------------------------------------------
// 16-bit conversions: spot values from the IEEE / bfloat16 definitions.
static void test_conversions() {
  CHECK(float_to_f16(1.0f) == 0x3C00, "1.0");
  CHECK(float_to_f16(-2.0f) == 0xC000, "-2");
  CHECK(float_to_f16(65504.0f) == 0x7BFF, "max");
  CHECK(float_to_f16(65520.0f) == 0x7C00, "65520 rounds to inf");
  CHECK(float_to_f16(ldexpf(1, -24)) == 0x0001, "min subnormal");
  CHECK(float_to_f16(ldexpf(1, -25)) == 0x0000, "half of min subnormal ties to even 0");
  CHECK(float_to_f16(ldexpf(3, -25)) == 0x0002, "1.5 min subnormal ties to even 2");
  CHECK(float_to_f16(1.0f + ldexpf(1, -11)) == 0x3C00, "tie to even (down)");
  CHECK(float_to_f16(1.0f + 3 * ldexpf(1, -11)) == 0x3C02, "tie to even (up)");
  CHECK(f16_to_float(0x0001) == ldexpf(1, -24), "subnormal decode");
  CHECK(f16_to_float(0x8400) == -ldexpf(1, -14), "min normal");
  CHECK(isinf(f16_to_float(0x7C00)) && isnan(f16_to_float(0x7E00)), "inf/nan");
  CHECK(float_to_bf16(1.0f) == 0x3F80 && bf16_to_float(0xC040) == -3.0f, "bf16");
  CHECK(float_to_bf16(1.0f + ldexpf(1, -8)) == 0x3F80 && float_to_bf16(1.0f + 3 * ldexpf(1, -8)) == 0x3F82, "bf16 ties");
  for (uint32_t h = 0; h < 0x10000; ++h) {  // every finite f16 survives a round trip
    if ((h & 0x7C00) == 0x7C00) continue;
    if (float_to_f16(f16_to_float(uint16_t(h))) != h) {
      CHECK(false, "f16 round trip %04x", h);
      break;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Tensor maps: the driver's requirement list.
static void test_encode() {
  alignas(128) uint8_t map[128];
  Aligned g(1 << 20, 256);
  // The sm90 launcher's view of [B=2, S=300, H=4, D=128] f16: dims (D, S, H, B), strides of
  // dims 1..3, box 64 x 128 rows x 1 x 1, SWIZZLE_128B.
  const uint64_t dims[4] = {128, 300, 4, 2};
  const uint64_t strides[3] = {4 * 128 * 2, 128 * 2, 300 * 4 * 128 * 2};
  const uint32_t box[4] = {64, 128, 1, 1};
  const uint32_t es[4] = {1, 1, 1, 1};
  auto enc4 = [&](void* m, int dt, uint32_t rank, void* ga, const uint64_t* d, const uint64_t* s, const uint32_t* b,
                  const uint32_t* e, int il, int sw, int oob) {
    return encode_tiled_checked(m, dt, rank, ga, d, s, b, e, il, sw, kL2_128B, oob);
  };
  const char* err = enc4(map, kF16, 4, g.p, dims, strides, box, es, 0, kSwizzle128B, 0);
  CHECK(err == nullptr, "valid map refused: %s", err ? err : "");
  const TensorMapInfo* info = decode(map);
  CHECK(info != nullptr, "decode of our map");
  if (info) {
    CHECK(info->rank == 4 && info->elem_bytes == 2 && info->swizzle == kSwizzle128B && info->data_type == kF16, "fields");
    CHECK(info->global_strides[0] == 2 && info->global_strides[1] == strides[0] && info->global_strides[3] == strides[2],
          "strides");
    CHECK(info->global_dim[1] == 300 && info->box_dim[1] == 128 && info->element_strides[3] == 1, "dims");
    CHECK(box_bytes(*info) == 64 * 128 * 2, "box bytes");
    CHECK(box_smem_alignment(*info) == 1024, "swizzle-128B alignment");
  }
  CHECK(exla_rs_gpusim_tensor_map_encode_tiled(map, kBF16, 4, g.p, dims, strides, box, es, 0, kSwizzle128B, 2, 0) == 0,
        "C ABI accepts");

  // Not ours: garbage, a flipped byte (checksum), a zeroed map.
  alignas(128) uint8_t other[128];
  memset(other, 0xAB, sizeof other);
  CHECK(decode(other) == nullptr, "garbage map decoded");
  memcpy(other, map, 128);
  other[70] ^= 1;
  CHECK(decode(other) == nullptr, "edited map decoded");
  memset(other, 0, sizeof other);
  CHECK(decode(other) == nullptr, "zero map decoded");

  // Each requirement broken once: returns 1 (CUDA_ERROR_INVALID_VALUE) and leaves the map alone.
  struct Bad {
    const char* what;
    int dt;
    uint32_t rank;
    size_t addr_off;
    uint64_t d0, s0;
    uint32_t b0, b1, e1;
    int il, sw, oob, l2;
    size_t map_off;
  };
  const Bad bad[] = {
      {"global address 8-byte aligned", kF16, 4, 8, 128, strides[0], 64, 128, 1, 0, kSwizzle128B, 0, 2, 0},
      {"stride not a multiple of 16", kF16, 4, 0, 128, strides[0] + 8, 64, 128, 1, 0, kSwizzle128B, 0, 2, 0},
      {"stride 2^40", kF16, 4, 0, 128, uint64_t(1) << 40, 64, 128, 1, 0, kSwizzle128B, 0, 2, 0},
      {"dim 0", kF16, 4, 0, 0, strides[0], 64, 128, 1, 0, kSwizzle128B, 0, 2, 0},
      {"dim 2^32 + 1", kF16, 4, 0, (uint64_t(1) << 32) + 1, strides[0], 64, 128, 1, 0, kSwizzle128B, 0, 2, 0},
      {"box 0", kF16, 4, 0, 128, strides[0], 64, 0, 1, 0, kSwizzle128B, 0, 2, 0},
      {"box 257", kF16, 4, 0, 128, strides[0], 64, 257, 1, 0, kSwizzle128B, 0, 2, 0},
      {"inner box 256 bytes > 128B swizzle", kF16, 4, 0, 128, strides[0], 128, 128, 1, 0, kSwizzle128B, 0, 2, 0},
      {"inner box 128 bytes > 64B swizzle", kF16, 4, 0, 128, strides[0], 64, 128, 1, 0, kSwizzle64B, 0, 2, 0},
      {"inner box 8 bytes (not a multiple of 16)", kF16, 4, 0, 128, strides[0], 4, 128, 1, 0, kSwizzleNone, 0, 2, 0},
      {"element stride 0", kF16, 4, 0, 128, strides[0], 64, 128, 0, 0, kSwizzle128B, 0, 2, 0},
      {"element stride 9", kF16, 4, 0, 128, strides[0], 64, 128, 9, 0, kSwizzle128B, 0, 2, 0},
      {"rank 0", kF16, 0, 0, 128, strides[0], 64, 128, 1, 0, kSwizzle128B, 0, 2, 0},
      {"rank 6", kF16, 6, 0, 128, strides[0], 64, 128, 1, 0, kSwizzle128B, 0, 2, 0},
      {"data type 16", 16, 4, 0, 128, strides[0], 64, 128, 1, 0, kSwizzle128B, 0, 2, 0},
      {"packed 16U4 (not modelled)", kPacked16U4Align8B, 4, 0, 128, strides[0], 64, 128, 1, 0, kSwizzleNone, 0, 2, 0},
      {"NaN fill on an integer type", kU16, 4, 0, 128, strides[0], 64, 128, 1, 0, kSwizzle128B, 1, 2, 0},
      {"oob fill 2", kF16, 4, 0, 128, strides[0], 64, 128, 1, 0, kSwizzle128B, 2, 2, 0},
      {"swizzle 7", kF16, 4, 0, 128, strides[0], 64, 128, 1, 0, 7, 0, 2, 0},
      {"l2 promotion 4", kF16, 4, 0, 128, strides[0], 64, 128, 1, 0, kSwizzle128B, 0, 4, 0},
      {"interleave 3", kF16, 4, 0, 128, strides[0], 64, 128, 1, 3, kSwizzle128B, 0, 2, 0},
      {"tensor map 32-byte aligned", kF16, 4, 0, 128, strides[0], 64, 128, 1, 0, kSwizzle128B, 0, 2, 32},
  };
  alignas(128) uint8_t big[256];
  for (const Bad& b : bad) {
    const uint64_t d[6] = {b.d0, 300, 4, 2, 1, 1};
    const uint64_t s[5] = {b.s0, strides[1], strides[2], strides[2] * 2, strides[2] * 4};
    const uint32_t bx[6] = {b.b0, b.b1, 1, 1, 1, 1};
    const uint32_t e[6] = {1, b.e1, 1, 1, 1, 1};
    memset(big, 0x5A, sizeof big);
    const int rc = exla_rs_gpusim_tensor_map_encode_tiled(big + b.map_off, b.dt, b.rank, g.p + b.addr_off, d, s, bx, e,
                                                          b.il, b.sw, b.l2, b.oob);
    CHECK(rc == 1, "accepted: %s", b.what);
    bool untouched = true;
    for (uint8_t x : big) untouched &= x == 0x5A;
    CHECK(untouched, "map written although refused: %s", b.what);
  }
  // The driver does not require monotone strides: our [B,S,H,D] view has S's stride above H's.
  // Rank 1 and 5 are valid.
  const uint64_t d1[1] = {1000};
  const uint32_t b1[1] = {256}, e1[1] = {1};
  CHECK(encode_tiled(map, kU8, 1, g.p, d1, nullptr, b1, e1, 0, 0, 0, 0) == 0, "rank 1");
  const uint64_t d5[5] = {16, 3, 3, 3, 3}, s5[4] = {32, 96, 288, 864};
  const uint32_t b5[5] = {16, 2, 2, 2, 2}, e5[5] = {1, 1, 1, 1, 1};
  CHECK(encode_tiled(map, kF16, 5, g.p, d5, s5, b5, e5, 0, 0, 0, 0) == 0, "rank 5");
}

// ------------------------------------------------------------------------------------------------
// TMA tile loads.

// Where the ISA puts box element (row r, byte b of the row) of a SWIZZLE_128B box at a 1024-byte
// aligned dst: 16-byte chunk b/16 of row r moves to chunk (b/16) ^ (r % 8) of the same row.
static uint32_t swz128_row_based(uint32_t dst, uint32_t r, uint32_t b) {
  return dst + r * 128 + (((b / 16) ^ (r % 8)) * 16) + b % 16;
}

static void test_tma() {
  // 2-D f16 tensor [300 rows, 192 cols] with a row pitch of 208 elements (padding), distinct bits.
  const uint32_t rows = 300, cols = 192, pitch = 208;
  Aligned g(size_t(rows) * pitch * 2, 128);
  auto bits = [](uint32_t r, uint32_t c) { return uint16_t((r * 977u + c * 131u + 1u) & 0x7BFF) | 1u; };
  for (uint32_t r = 0; r < rows; ++r)
    for (uint32_t c = 0; c < pitch; ++c) put16(g.p, (r * pitch + c) * 2, c < cols ? bits(r, c) : 0xDEAD);
  alignas(128) uint8_t mapb[128];
  const uint64_t dims[2] = {cols, rows}, strides[1] = {pitch * 2};
  const uint32_t box[2] = {64, 128}, es[2] = {1, 1};
  CHECK(encode_tiled(mapb, kF16, 2, g.p, dims, strides, box, es, 0, kSwizzle128B, 0, 0) == 0, "encode");
  const TensorMapInfo* m = decode(mapb);
  CHECK(m, "decode");
  if (!m) return;
  const size_t smem_size = 3 * 16384 + 1024;
  Aligned smem(smem_size, 1024);
  struct Case {
    int32_t c0, c1;
  };
  const Case cases[] = {{64, 0}, {128, 250}, {-8, -3}, {160, 299}, {-64, 0}, {192, 0}};
  for (const Case& cs : cases) {
    memset(smem.p, 0xCC, smem_size);
    const uint32_t dst = 16384 + 1024;
    uint32_t bytes = 0;
    const int32_t coords[2] = {cs.c0, cs.c1};
    const char* err = tma_load_box(*m, 2, coords, smem.p, smem_size, dst, &bytes);
    CHECK(err == nullptr, "load (%d,%d): %s", cs.c0, cs.c1, err ? err : "");
    CHECK(bytes == 64 * 128 * 2, "bytes %u (out-of-bounds elements count)", bytes);
    bool ok = true;
    for (uint32_t r = 0; r < 128; ++r)
      for (uint32_t c = 0; c < 64; ++c) {
        const int64_t gr = int64_t(cs.c1) + r, gc = int64_t(cs.c0) + c;
        const bool in = gr >= 0 && gr < rows && gc >= 0 && gc < cols;
        const uint16_t want = in ? bits(uint32_t(gr), uint32_t(gc)) : 0;
        ok &= get16(smem.p, swz128_row_based(dst, r, c * 2)) == want;
      }
    CHECK(ok, "box (%d,%d) contents", cs.c0, cs.c1);
    bool outside_untouched = true;
    for (size_t i = 0; i < smem_size; ++i)
      if (i < dst || i >= dst + 16384) outside_untouched &= smem.p[i] == 0xCC;
    CHECK(outside_untouched, "bytes written outside the box (%d,%d)", cs.c0, cs.c1);
  }
  // Errors: misaligned dst (128-aligned but not 1024), box past smem, coordinate count.
  uint32_t bytes = 0;
  const int32_t c2[2] = {0, 0};
  CHECK(tma_load_box(*m, 2, c2, smem.p, smem_size, 512, &bytes) != nullptr, "dst 512 accepted for SWIZZLE_128B");
  CHECK(tma_load_box(*m, 2, c2, smem.p, smem_size, 3 * 16384, &bytes) != nullptr, "box past smem accepted");
  CHECK(tma_load_box(*m, 4, c2, smem.p, smem_size, 0, &bytes) != nullptr, "4 coordinates for a rank-2 map accepted");

  // NaN fill, no swizzle, element stride 2 along rows, box narrower than a row: dense rows.
  alignas(128) uint8_t mapn[128];
  const uint32_t boxn[2] = {16, 8}, esn[2] = {1, 2};
  CHECK(encode_tiled(mapn, kF16, 2, g.p, dims, strides, boxn, esn, 0, kSwizzleNone, 0, kOobFillNanRequestZeroFma) == 0,
        "encode nan");
  const TensorMapInfo* mn = decode(mapn);
  if (mn) {
    CHECK(box_bytes(*mn) == 16 * 4 * 2, "element stride halves the rows");
    memset(smem.p, 0xCC, smem_size);
    const int32_t cn[2] = {184, 295};  // cols 184..199 (192.. OOB), rows 295, 297, 299, 301 (OOB)
    CHECK(tma_load_box(*mn, 2, cn, smem.p, smem_size, 128, &bytes) == nullptr && bytes == 128, "load nan box");
    bool ok = true;
    for (uint32_t r = 0; r < 4; ++r)
      for (uint32_t c = 0; c < 16; ++c) {
        const uint32_t gr = 295 + 2 * r, gc = 184 + c;
        const uint16_t v = get16(smem.p, 128 + (r * 16 + c) * 2);
        ok &= (gr < rows && gc < cols) ? v == bits(gr, gc) : isnan(f16_to_float(v));
      }
    CHECK(ok, "nan-filled, strided box");
    CHECK(tma_load_box(*mn, 2, cn, smem.p, smem_size, 64, &bytes) != nullptr, "dst 64 accepted (needs 128)");
  }
  // A 128B-swizzled map whose box row is 64 bytes is valid for the driver but not modelled here.
  alignas(128) uint8_t maph[128];
  const uint32_t boxh[2] = {32, 8};
  CHECK(encode_tiled(maph, kF16, 2, g.p, dims, strides, boxh, es, 0, kSwizzle128B, 0, 0) == 0, "encode half row");
  if (const TensorMapInfo* mh = decode(maph))
    CHECK(tma_load_box(*mh, 2, c2, smem.p, smem_size, 0, &bytes) != nullptr, "half-row swizzled box silently modelled");
}

// ------------------------------------------------------------------------------------------------
// wgmma from hand-placed operands.

struct Mat {
  int r, c;
  std::vector<float> v;  // row-major, values exactly representable in the input type
  Mat(int r_, int c_) : r(r_), c(c_), v(size_t(r_) * c_) {}
  float& at(int i, int j) { return v[size_t(i) * c + j]; }
  float at(int i, int j) const { return v[size_t(i) * c + j]; }
};

static Mat random_mat(int r, int c, bool bf16, std::mt19937& rng, bool small_ints) {
  Mat m(r, c);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> ud(-8, 8);
  for (float& x : m.v) x = dec(bf16, enc(bf16, small_ints ? float(ud(rng)) * 0.25f : nd(rng)));
  return m;
}

// K-major, 128B swizzle [PTX-WG Figure 157 / canonical layout]: row i of the operand (M or N
// index) is 128-byte row (i % 8) of the 8-row group i / 8 (groups SBO bytes apart), k its
// element; chunk (2k / 16) of each 128-byte row XOR the row's address bits 7-9.
static void place_kmajor_sw128(uint8_t* smem, uint32_t start, uint32_t sbo, const Mat& op_ik, bool bf16) {
  for (int i = 0; i < op_ik.r; ++i)
    for (int k = 0; k < op_ik.c; ++k) {
      const uint32_t a = start + (i / 8) * sbo + (i % 8) * 128 + 2 * k;
      put16(smem, a ^ (((a >> 7) & 7) << 4), enc(bf16, op_ik.at(i, k)));
    }
}

// MN-major, 128B swizzle: 64 consecutive MN elements fill a 128-byte row, one row per k
// (8 rows an atom), atoms along K SBO apart, 64-element MN blocks LBO apart.
static void place_mnmajor_sw128(uint8_t* smem, uint32_t start, uint32_t lbo, uint32_t sbo, const Mat& op_kn,
                                bool bf16) {
  for (int k = 0; k < op_kn.r; ++k)
    for (int n = 0; n < op_kn.c; ++n) {
      const uint32_t a = start + (n / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + 2 * (n % 64);
      put16(smem, a ^ (((a >> 7) & 7) << 4), enc(bf16, op_kn.at(k, n)));
    }
}

// K-major without swizzle: core matrices of 8 rows x 16 bytes (rows 16 bytes apart); the next
// core matrix along K is LBO away, along M/N SBO away.
static void place_kmajor_none(uint8_t* smem, uint32_t start, uint32_t lbo, uint32_t sbo, const Mat& op_ik, bool bf16) {
  for (int i = 0; i < op_ik.r; ++i)
    for (int k = 0; k < op_ik.c; ++k)
      put16(smem, start + (i / 8) * sbo + (k / 8) * lbo + (i % 8) * 16 + 2 * (k % 8), enc(bf16, op_ik.at(i, k)));
}

static uint64_t desc(uint32_t start, uint32_t lbo, uint32_t sbo, uint32_t swz) {
  // Written from the ISA's bit table, independently of encode_desc.
  return uint64_t((start & 0x3FFFF) >> 4) | (uint64_t((lbo & 0x3FFFF) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFF) >> 4) << 32) | (uint64_t(swz) << 62);
}

struct Acc {
  std::vector<float> buf;
  float* ptr[128];
  int n;
  explicit Acc(int n_) : buf(size_t(128) * (n_ / 2)), n(n_) {
    for (int t = 0; t < 128; ++t) ptr[t] = buf.data() + size_t(t) * (n_ / 2);
  }
  // Fragment rule written out for the test: warp w holds rows 16w..16w+15; d[e] is row
  // lane/4 (+8 for e%4 in {2,3}), column 8 (e/4) + 2 (lane%4) + (e%2).
  float& at(int row, int col) {
    const int w = row / 16, g = row % 8, hi = (row % 16) / 8;
    const int q = (col % 8) / 2;
    const int t = 32 * w + 4 * g + q;
    const int e = 4 * (col / 8) + 2 * hi + (col % 2);
    return ptr[t][e];
  }
};

// Expected D = s_d * D0 + (sa A)(sb B) in float64; compared with a tolerance from the f32 sum.
static bool compare(Acc& acc, const Mat& A, const Mat& Bkn, const Mat* D0, double sa, double sb, double* max_err) {
  bool ok = true;
  *max_err = 0;
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < Bkn.c; ++n) {
      double s = D0 ? D0->at(m, n) : 0.0, mag = fabs(s);
      for (int k = 0; k < 16; ++k) {
        s += sa * A.at(m, k) * sb * Bkn.at(k, n);
        mag += fabs(A.at(m, k) * Bkn.at(k, n));
      }
      const double got = acc.at(m, n), err = fabs(got - s);
      *max_err = fmax(*max_err, err);
      ok &= err <= 17 * ldexp(1.0, -24) * mag + 1e-30;
    }
  return ok;
}

static Mat transpose(const Mat& a) {
  Mat t(a.c, a.r);
  for (int i = 0; i < a.r; ++i)
    for (int j = 0; j < a.c; ++j) t.at(j, i) = a.at(i, j);
  return t;
}

static void test_wgmma_ss() {
  std::mt19937 rng(1234);
  const size_t smem_size = 96 * 1024;
  Aligned smem(smem_size, 1024);
  for (int bf = 0; bf < 2; ++bf)
    for (int n : {64, 128, 256})
      for (int trans_b = 0; trans_b < 2; ++trans_b)
        for (int scale_d = 0; scale_d < 2; ++scale_d) {
          const bool bf16 = bf == 1;
          memset(smem.p, 0xFF, smem_size);  // NaN everywhere the operands do not cover
          Mat A = random_mat(64, 16, bf16, rng, false);
          Mat B = random_mat(16, n, bf16, rng, false);  // B[k][n]
          // A at 4096 + 32 (the second k-step of a 128-byte row, as the kernels advance): the
          // swizzle is a function of the address, so the atom stays 1024-aligned at 4096.
          place_kmajor_sw128(smem.p, 4096 + 32, 1024, A, bf16);
          uint64_t db;
          if (trans_b) {  // N-major: LBO between 64-column blocks (16 rows x 128 B each -> 2048)
            place_mnmajor_sw128(smem.p, 32768, 2048, 1024, B, bf16);
            db = desc(32768, 2048, 1024, 1);
          } else {  // K-major: B^T rows, 8-row groups 1024 apart, at 64 bytes into the rows
            place_kmajor_sw128(smem.p, 32768 + 64, 1024, transpose(B), bf16);
            db = desc(32768 + 64, 16, 1024, 1);
          }
          Acc acc(n);
          Mat D0 = random_mat(64, n, bf16, rng, false);
          for (int m = 0; m < 64; ++m)
            for (int j = 0; j < n; ++j) acc.at(m, j) = scale_d ? D0.at(m, j) : NAN;
          WgmmaOp op;
          op.n = n;
          op.input = bf16 ? kWgmmaBF16 : kWgmmaF16;
          op.desc_a = desc(4096 + 32, 16, 1024, 1);
          op.desc_b = db;
          op.scale_d = scale_d;
          op.trans_b = trans_b;
          const char* err = wgmma(op, smem.p, smem_size, acc.ptr, nullptr);
          CHECK(err == nullptr, "wgmma: %s", err ? err : "");
          double e;
          CHECK(compare(acc, A, B, scale_d ? &D0 : nullptr, 1, 1, &e), "SS %s n%d trans_b %d scale_d %d: max err %g",
                bf16 ? "bf16" : "f16", n, trans_b, scale_d, e);
        }
  // Exact small-integer case: every partial sum is exact in f32, so the result must be exact;
  // imm-scale-a = -1, A M-major (imm-trans-a = 1), B without swizzle (K-major, LBO used).
  {
    memset(smem.p, 0xFF, smem_size);
    Mat A = random_mat(64, 16, false, rng, true), B = random_mat(16, 64, false, rng, true);
    place_mnmajor_sw128(smem.p, 0, 1 << 20, 1024, transpose(A), false);  // A^T[k][m]: 64 M fit one block
    place_kmajor_none(smem.p, 8192, 128, 256, transpose(B), false);       // LBO 128: K halves; SBO 256
    WgmmaOp op;
    op.n = 64;
    op.desc_a = desc(0, 0, 1024, 1);
    op.desc_b = desc(8192, 128, 256, 0);
    op.trans_a = 1;
    op.scale_a = -1;
    op.scale_d = 0;
    Acc acc(64);
    CHECK(wgmma(op, smem.p, smem_size, acc.ptr, nullptr) == nullptr, "exact case");
    bool exact = true;
    for (int m = 0; m < 64; ++m)
      for (int j = 0; j < 64; ++j) {
        double s = 0;
        for (int k = 0; k < 16; ++k) s -= double(A.at(m, k)) * B.at(k, j);
        exact &= acc.at(m, j) == s;
      }
    CHECK(exact, "M-major A, unswizzled B, scale-a -1");
    // Byte ranges: B unswizzled: 8 groups of 256 bytes, each two 128-byte core matrices.
    std::vector<ByteRange> r;
    CHECK(wgmma_smem_ranges(op, smem_size, &r) == nullptr, "ranges");
    CHECK(r.size() == 2 && r[0].begin == 0 && r[0].end == 2048 && r[1].begin == 8192 && r[1].end == 8192 + 2048,
          "ranges %zu [%u,%u)", r.size(), r.empty() ? 0 : r[0].begin, r.empty() ? 0 : r[0].end);
  }
  // Errors: a descriptor past smem, a non-zero base offset, N out of range, trans-a in RS.
  {
    WgmmaOp op;
    op.n = 64;
    op.desc_a = desc(0, 16, 1024, 1);
    op.desc_b = desc(uint32_t(smem_size) - 1024, 16, 1024, 1);
    Acc acc(64);
    std::vector<ByteRange> r;
    CHECK(wgmma_smem_ranges(op, smem_size, &r) != nullptr, "B past smem accepted");
    CHECK(wgmma(op, smem.p, smem_size, acc.ptr, nullptr) != nullptr, "B past smem computed");
    op.desc_b = desc(0, 16, 1024, 1) | (uint64_t(3) << 49);
    CHECK(wgmma(op, smem.p, smem_size, acc.ptr, nullptr) != nullptr, "base offset accepted");
    op.desc_b = desc(0, 16, 1024, 1);
    op.n = 260;
    CHECK(wgmma(op, smem.p, smem_size, acc.ptr, nullptr) != nullptr, "N 260 accepted");
    op.n = 64;
    op.a_regs = true;
    op.trans_a = 1;
    uint32_t regs[128][4] = {};
    CHECK(wgmma(op, smem.p, smem_size, acc.ptr, regs) != nullptr, "trans-a in RS accepted");
  }
  // Descriptor round trip.
  const uint64_t d = desc(0x1A400 + 96, 16384, 1024, 1);
  const SmemDesc s = decode_desc(d);
  CHECK(s.start == 0x1A400 + 96 && s.lbo == 16384 && s.sbo == 1024 && s.swizzle == 1 && s.base_offset == 0, "desc");
  CHECK(encode_desc(s) == d, "desc round trip");
}

// RS: A from registers, laid out by the ISA's m64nNk16 A-fragment table (Figure 148), written
// out here: thread t = 32 w + 4 g + q holds, in register j, A[16w + g + 8 (j%2)][2q + 8 (j/2) + {0,1}]
// (lower column in the low half).
static void pack_a_regs(const Mat& A, bool bf16, uint32_t regs[128][4]) {
  for (int t = 0; t < 128; ++t) {
    const int w = t / 32, g = (t % 32) / 4, q = t % 4;
    for (int j = 0; j < 4; ++j) {
      const int r = 16 * w + g + 8 * (j % 2), c = 2 * q + 8 * (j / 2);
      regs[t][j] = uint32_t(enc(bf16, A.at(r, c))) | (uint32_t(enc(bf16, A.at(r, c + 1))) << 16);
    }
  }
}

static void test_wgmma_rs() {
  std::mt19937 rng(99);
  const size_t smem_size = 64 * 1024;
  Aligned smem(smem_size, 1024);
  static uint32_t regs[128][4];
  for (int bf = 0; bf < 2; ++bf)
    for (int n : {64, 128, 256})
      for (int trans_b = 0; trans_b < 2; ++trans_b) {
        const bool bf16 = bf == 1;
        memset(smem.p, 0xFF, smem_size);
        Mat A = random_mat(64, 16, bf16, rng, false), B = random_mat(16, n, bf16, rng, false);
        pack_a_regs(A, bf16, regs);
        WgmmaOp op;
        op.n = n;
        op.input = bf16 ? kWgmmaBF16 : kWgmmaF16;
        op.a_regs = true;
        op.trans_b = trans_b;
        op.scale_d = 1;
        op.scale_b = -1;
        if (trans_b) {
          place_mnmajor_sw128(smem.p, 8192, 4096, 1024, B, bf16);
          op.desc_b = desc(8192, 4096, 1024, 1);
        } else {
          place_kmajor_sw128(smem.p, 8192 + 96, 1024, transpose(B), bf16);
          op.desc_b = desc(8192 + 96, 16, 1024, 1);
        }
        Acc acc(n);
        Mat D0 = random_mat(64, n, bf16, rng, false);
        for (int m = 0; m < 64; ++m)
          for (int j = 0; j < n; ++j) acc.at(m, j) = D0.at(m, j);
        const char* err = wgmma(op, smem.p, smem_size, acc.ptr, regs);
        CHECK(err == nullptr, "rs: %s", err ? err : "");
        double e;
        CHECK(compare(acc, A, B, &D0, 1, -1, &e), "RS %s n%d trans_b %d: max err %g", bf16 ? "bf16" : "f16", n, trans_b, e);
        std::vector<ByteRange> r;
        CHECK(wgmma_smem_ranges(op, smem_size, &r) == nullptr && !r.empty(), "rs ranges");
        size_t total = 0;
        for (const ByteRange& x : r) total += x.end - x.begin;
        CHECK(total == size_t(n) * 16 * 2, "RS reads exactly B (%zu bytes)", total);
      }
}

// ------------------------------------------------------------------------------------------------
// Round trip with the kernel's scheme (flash_fwd_sm90.cuh): TMA boxes of 64 columns x rows with
// SWIZZLE_128B into column blocks, S = Q K^T by wgmma SS over the head dim, O = P V by wgmma RS.
// The descriptor arithmetic is the kernel's (kmajor_kstep_offset, v_desc, smem_desc); the
// reference is a float64 matmul of the tensors as stored in global memory.

static void kernel_round_trip(int D, bool bf16, uint32_t seed) {
  const int BM = 128, BN = D <= 128 ? 128 : 64, cols = D / 64;
  const int Sq = 150, Sk = 100, H = 2, B = 1;  // Sk < BN for D <= 128: out-of-bounds key rows
  std::mt19937 rng(seed);
  auto make = [&](int S) {
    Aligned* a = new Aligned(size_t(B) * S * H * D * 2, 128);
    std::normal_distribution<float> nd(0, 1);
    for (size_t i = 0; i < size_t(B) * S * H * D; ++i) put16(a->p, uint32_t(i * 2), enc(bf16, nd(rng)));
    return a;
  };
  Aligned* q = make(Sq);
  Aligned* k = make(Sk);
  Aligned* v = make(Sk);
  auto map_of = [&](Aligned* t, int S, int rows, uint8_t* out) {
    const uint64_t dims[4] = {uint64_t(D), uint64_t(S), uint64_t(H), uint64_t(B)};
    const uint64_t strides[3] = {uint64_t(H) * D * 2, uint64_t(D) * 2, uint64_t(S) * H * D * 2};
    const uint32_t box[4] = {64, uint32_t(rows), 1, 1}, es[4] = {1, 1, 1, 1};
    return encode_tiled(out, bf16 ? kBF16 : kF16, 4, t->p, dims, strides, box, es, 0, kSwizzle128B, 2, 0);
  };
  alignas(128) uint8_t mq[128], mk[128], mv[128];
  CHECK(map_of(q, Sq, BM, mq) == 0 && map_of(k, Sk, BN, mk) == 0 && map_of(v, Sk, BN, mv) == 0, "maps");
  const uint32_t q_off = 0, k_off = BM * D * 2, v_off = k_off + BN * D * 2;
  const size_t smem_size = v_off + BN * D * 2;
  Aligned smem(smem_size, 1024);
  memset(smem.p, 0xFF, smem_size);
  const int head = 1, m0 = 128, n0 = 0;  // query rows 128..255 (150.. are OOB), keys 0..BN-1
  uint32_t total = 0, bytes = 0;
  for (int c = 0; c < cols; ++c) {
    const int32_t cq[4] = {c * 64, m0, head, 0}, ck[4] = {c * 64, n0, head, 0};
    CHECK(tma_load_box(*decode(mq), 4, cq, smem.p, smem_size, q_off + c * BM * 128, &bytes) == nullptr, "q");
    total += bytes;
    CHECK(tma_load_box(*decode(mk), 4, ck, smem.p, smem_size, k_off + c * BN * 128, &bytes) == nullptr, "k");
    total += bytes;
    CHECK(tma_load_box(*decode(mv), 4, ck, smem.p, smem_size, v_off + c * BN * 128, &bytes) == nullptr, "v");
    total += bytes;
  }
  CHECK(total == uint32_t(BM + 2 * BN) * D * 2, "tx bytes %u (kQBytes + 2 kKVBytes)", total);
  auto g = [&](Aligned* t, int S, int row, int col) {
    if (row >= S) return 0.0;  // out-of-bounds rows arrive as zeros
    return double(dec(bf16, get16(t->p, uint32_t(((row * H + head) * D + col) * 2))));
  };
  auto kmajor_kstep_offset = [](int kk, int rows_in_block) { return (kk / 4) * rows_in_block * 128 + (kk % 4) * 32; };
  auto smem_desc = [](uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo & 0x3FFFF) >> 4) << 16) |
           (uint64_t((sbo & 0x3FFFF) >> 4) << 32) | (uint64_t(1) << 62);
  };
  for (int consumer = 0; consumer < 2; ++consumer) {
    // S = Q K^T for this consumer's 64 rows.
    Acc s(BN);
    const uint32_t q_addr = q_off + consumer * 64 * 128;
    for (int kk = 0; kk < D / 16; ++kk) {
      WgmmaOp op;
      op.n = BN;
      op.input = bf16 ? kWgmmaBF16 : kWgmmaF16;
      op.desc_a = smem_desc(q_addr + kmajor_kstep_offset(kk, BM), 16, 1024);
      op.desc_b = smem_desc(k_off + kmajor_kstep_offset(kk, BN), 16, 1024);
      op.scale_d = kk > 0;
      CHECK(wgmma(op, smem.p, smem_size, s.ptr, nullptr) == nullptr, "S wgmma");
    }
    bool ok = true;
    double worst = 0;
    for (int r = 0; r < 64; ++r)
      for (int j = 0; j < BN; ++j) {
        double ref = 0, mag = 0;
        for (int d = 0; d < D; ++d) {
          const double x = g(q, Sq, m0 + consumer * 64 + r, d) * g(k, Sk, n0 + j, d);
          ref += x;
          mag += fabs(x);
        }
        const double err = fabs(s.at(r, j) - ref);
        worst = fmax(worst, err / (mag + 1e-30));
        ok &= err <= (D + 2) * ldexp(1.0, -24) * mag;
      }
    CHECK(ok, "S = Q K^T D%d %s consumer %d: worst rel err %g", D, bf16 ? "bf16" : "f16", consumer, worst);
    // O = P V: P in registers re-packed from the S accumulator as the kernel does
    // (pf[kk][j] = pack2(s[8kk + 2j], s[8kk + 2j + 1])), V MN-major via v_desc.
    Mat P(64, BN);
    for (int r = 0; r < 64; ++r)
      for (int j = 0; j < BN; ++j) P.at(r, j) = dec(bf16, enc(bf16, s.at(r, j) * 0.05f));
    Acc o(D);
    for (int r = 0; r < 64; ++r)
      for (int d = 0; d < D; ++d) o.at(r, d) = 0.f;
    static uint32_t pf[16][128][4];
    for (int t = 0; t < 128; ++t)
      for (int kk = 0; kk < BN / 16; ++kk)
        for (int j = 0; j < 4; ++j) {
          // s[8kk + 2j + {0,1}] of thread t, read through the accumulator rule.
          int r0, c0, r1, c1;
          acc_position(t, 8 * kk + 2 * j, &r0, &c0);
          acc_position(t, 8 * kk + 2 * j + 1, &r1, &c1);
          pf[kk][t][j] = uint32_t(enc(bf16, P.at(r0, c0))) | (uint32_t(enc(bf16, P.at(r1, c1))) << 16);
        }
    for (int kk = 0; kk < BN / 16; ++kk) {
      WgmmaOp op;
      op.n = D;
      op.input = bf16 ? kWgmmaBF16 : kWgmmaF16;
      op.a_regs = true;
      op.trans_b = 1;
      op.desc_b = smem_desc(v_off + kk * 16 * 128, BN * 128, 1024);  // v_desc
      op.scale_d = 1;
      CHECK(wgmma(op, smem.p, smem_size, o.ptr, pf[kk]) == nullptr, "PV wgmma");
    }
    ok = true;
    worst = 0;
    for (int r = 0; r < 64; ++r)
      for (int d = 0; d < D; ++d) {
        double ref = 0, mag = 0;
        for (int j = 0; j < BN; ++j) {
          const double x = double(P.at(r, j)) * g(v, Sk, n0 + j, d);
          ref += x;
          mag += fabs(x);
        }
        const double err = fabs(o.at(r, d) - ref);
        worst = fmax(worst, err / (mag + 1e-30));
        ok &= err <= (BN + 2) * ldexp(1.0, -24) * mag;
      }
    CHECK(ok, "O = P V D%d %s consumer %d: worst rel err %g", D, bf16 ? "bf16" : "f16", consumer, worst);
  }
  delete q;
  delete k;
  delete v;
}

// ------------------------------------------------------------------------------------------------
// The kernel's tile scheme read back exactly (the self-check of the retired Python sm90 emulator,
// and its cross-check with this file): a 128 x 128 tile of
// the distinct values 0..16383, TMA-loaded as two 64-column SWIZZLE_128B boxes at shared address
// 8192, lands where the ISA's row-based swizzle puts it; the operands the model reads through the
// kernel's descriptors (flash_fwd_sm90.cuh kmajor_kstep_offset for Q/K, v_desc for V) are then the
// tile's columns 16 kk.. (K-major, 128 rows) and rows 16 kk.. (MN-major, 128 columns), value for
// value; and the accumulator fragment (acc_position) covers a 64 x N tile exactly once.
static void test_kernel_tile_scheme_exactly() {
  const uint32_t n = 128, base = 8192;
  Aligned g(n * n * 2, 128);
  for (uint32_t i = 0; i < n * n; ++i) put16(g.p, i * 2, uint16_t(i));
  alignas(128) uint8_t map[128];
  const uint64_t dims[2] = {n, n}, strides[1] = {n * 2};
  const uint32_t box[2] = {64, n}, es[2] = {1, 1};
  CHECK(encode_tiled(map, kU16, 2, g.p, dims, strides, box, es, 0, kSwizzle128B, 0, 0) == 0, "encode");
  const size_t smem_size = base + 2 * n * 128;
  Aligned smem(smem_size, 1024);
  memset(smem.p, 0, smem_size);
  for (int c = 0; c < 2; ++c) {
    const int32_t co[2] = {c * 64, 0};
    uint32_t bytes;
    CHECK(tma_load_box(*decode(map), 2, co, smem.p, smem_size, base + c * n * 128, &bytes) == nullptr, "box %d", c);
  }
  bool layout = true;
  for (uint32_t c = 0; c < 2; ++c)
    for (uint32_t r = 0; r < n; ++r)
      for (uint32_t e = 0; e < 64; ++e) layout &= get16(smem.p, swz128_row_based(base + c * n * 128, r, e * 2)) == r * n + c * 64 + e;
  CHECK(layout, "TMA SWIZZLE_128B layout of the two boxes");
  for (int kk = 0; kk < 8; ++kk) {
    // Q/K: K-major, a k-step is 32 bytes into the 128-byte rows, the next column block every 4.
    const SmemDesc dk = decode_desc(desc(base + (kk / 4) * n * 128 + (kk % 4) * 32, 16, 1024, 1));
    // V: MN-major (transposed B), a k-step is 16 rows; 64-column blocks LBO apart, 8-row atoms SBO.
    const SmemDesc dv = decode_desc(desc(base + kk * 16 * 128, n * 128, 1024, 1));
    bool kmajor = true, mnmajor = true;
    for (uint32_t m = 0; m < n; ++m)
      for (uint32_t k = 0; k < 16; ++k) {
        uint32_t a = 0, b = 0;
        kmajor &= operand_address(dk, false, m, k, &a) == nullptr && get16(smem.p, a) == m * n + 16 * kk + k;
        mnmajor &= operand_address(dv, true, m, k, &b) == nullptr && get16(smem.p, b) == (16 * kk + k) * n + m;
      }
    CHECK(kmajor, "K-major operand of k-step %d is not the tile's columns %d..%d", kk, 16 * kk, 16 * kk + 15);
    CHECK(mnmajor, "MN-major operand of k-step %d is not the tile's rows %d..%d", kk, 16 * kk, 16 * kk + 15);
  }
  for (int cols : {64, 128, 256}) {
    std::vector<int> hits(size_t(64) * cols, 0);
    for (int t = 0; t < 128; ++t)
      for (int e = 0; e < cols / 2; ++e) {
        int r, c;
        acc_position(t, e, &r, &c);
        if (r >= 0 && r < 64 && c >= 0 && c < cols) ++hits[size_t(r) * cols + c];
      }
    bool once = true;
    for (int h : hits) once &= h == 1;
    CHECK(once, "the accumulator fragment covers the 64 x %d tile exactly once", cols);
  }
}

int main() {
  test_conversions();
  test_encode();
  test_tma();
  test_wgmma_ss();
  test_wgmma_rs();
  test_kernel_tile_scheme_exactly();
  for (int D : {64, 128, 256})
    for (int bf = 0; bf < 2; ++bf) kernel_round_trip(D, bf == 1, 7u + D + bf);
  printf("%s: %d checks, %d failures\n", g_failures ? "FAIL" : "ok", g_checks, g_failures);
  return g_failures ? 1 : 0;
}
