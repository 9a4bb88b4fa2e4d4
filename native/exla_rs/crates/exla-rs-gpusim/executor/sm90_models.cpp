// Models of the Hopper TMA / tensor-map / wgmma instructions: see sm90_models.hpp for the sources
// ([DRV], [PTX-TMA], [PTX-WG]) each rule below cites.
#include "sm90_models.hpp"

#include <math.h>
#include <string.h>

#include <algorithm>

#include "exec.h"
#include "runtime.hpp"

namespace exla_rs_gpusim {
namespace sm90 {

namespace {

uint32_t fnv1a(const uint8_t* p, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 16777619u;
  return h;
}

uint32_t checksum_of(const TensorMapInfo& m) {
  TensorMapInfo c;
  memcpy(&c, &m, sizeof c);
  c.checksum = 0;
  return fnv1a(reinterpret_cast<const uint8_t*>(&c), sizeof c);
}

// Element size of each CUtensorMapDataType [DRV] (0: packed sub-byte types, not modelled).
uint32_t elem_size(int t) {
  switch (t) {
    case kU8: return 1;
    case kU16: case kF16: case kBF16: return 2;
    case kU32: case kI32: case kF32: case kF32Ftz: case kTF32: case kTF32Ftz: return 4;
    case kU64: case kI64: case kF64: return 8;
    default: return 0;
  }
}

bool is_float_type(int t) {
  return t == kF16 || t == kF32 || t == kF64 || t == kBF16 || t == kF32Ftz || t == kTF32 || t == kTF32Ftz;
}

// Swizzle span in 16-byte chunks of a CUtensorMapSwizzle value (1 for none).
uint32_t tma_chunks16(int swizzle) {
  switch (swizzle) {
    case kSwizzle32B: return 2;
    case kSwizzle64B: return 4;
    case kSwizzle128B: return 8;
    default: return 1;
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Tensor maps [DRV]: the requirement list of cuTensorMapEncodeTiled, in the documentation's order.

const char* encode_tiled_checked(void* map128, int data_type, uint32_t rank, void* global_address,
                                 const uint64_t* global_dim, const uint64_t* global_strides,
                                 const uint32_t* box_dim, const uint32_t* element_strides, int interleave,
                                 int swizzle, int l2_promotion, int oob_fill) {
  if (!map128) return "tensorMap is null";
  if (reinterpret_cast<uintptr_t>(map128) % 64) return "tensorMap address must be aligned to 64 bytes";
  if (data_type < 0 || data_type > kPacked16U6Align16B) return "tensorDataType is not a CUtensorMapDataType";
  const uint32_t eb = elem_size(data_type);
  if (eb == 0) return "tensorDataType: the packed 16U4/16U6 types are not modelled";
  if (interleave < kInterleaveNone || interleave > kInterleave32B) return "interleave is not a CUtensorMapInterleave";
  if (rank == 0 || rank > 5) return "tensorRank must be non-zero and at most 5";
  if (interleave != kInterleaveNone && rank < 3) return "tensorRank must be >= 3 with interleave";
  if (interleave != kInterleaveNone) return "interleaved layouts are not modelled";
  const uint64_t ga = reinterpret_cast<uintptr_t>(global_address);
  if (ga % 16) return "globalAddress must be 16-byte aligned";
  if (!global_dim || !box_dim || !element_strides || (rank > 1 && !global_strides)) return "an array argument is null";
  for (uint32_t i = 0; i < rank; ++i)
    if (global_dim[i] == 0 || global_dim[i] > (uint64_t(1) << 32)) return "globalDim must be non-zero and <= 2^32";
  for (uint32_t i = 0; i + 1 < rank; ++i) {
    if (global_strides[i] % 16) return "globalStrides must be multiples of 16";
    if (global_strides[i] >= (uint64_t(1) << 40)) return "globalStrides must be less than 2^40";
  }
  for (uint32_t i = 0; i < rank; ++i)
    if (box_dim[i] == 0 || box_dim[i] > 256) return "boxDim must be non-zero and <= 256";
  if ((uint64_t(box_dim[0]) * eb) % 16) return "boxDim[0] * elementSize must be a multiple of 16 bytes";
  for (uint32_t i = 0; i < rank; ++i)
    if (element_strides[i] == 0 || element_strides[i] > 8) return "elementStrides must be non-zero and <= 8";
  if (swizzle < kSwizzleNone || swizzle > kSwizzle128BAtom64B) return "swizzle is not a CUtensorMapSwizzle";
  if (swizzle != kSwizzleNone) {
    const uint64_t inner = uint64_t(box_dim[0]) * eb;
    const uint64_t span = swizzle == kSwizzle32B ? 32 : swizzle == kSwizzle64B ? 64 : 128;
    if (inner > span) return "the bounding box inner dimension (boxDim[0] * elementSize) exceeds the swizzle size";
  }
  if (swizzle >= kSwizzle128BAtom32B) return "the 128B_ATOM_* swizzle modes are not modelled";
  if (l2_promotion < kL2None || l2_promotion > kL2_256B) return "l2Promotion is not a CUtensorMapL2promotion";
  if (oob_fill < kOobFillNone || oob_fill > kOobFillNanRequestZeroFma) return "oobFill is not a CUtensorMapFloatOOBfill";
  if (oob_fill == kOobFillNanRequestZeroFma && !is_float_type(data_type))
    return "OOB_FILL_NAN_REQUEST_ZERO_FMA needs a floating-point tensorDataType";

  TensorMapInfo m;
  memset(&m, 0, sizeof m);
  m.magic = kTensorMapMagic;
  m.data_type = static_cast<uint8_t>(data_type);
  m.rank = static_cast<uint8_t>(rank);
  m.interleave = static_cast<uint8_t>(interleave);
  m.swizzle = static_cast<uint8_t>(swizzle);
  m.l2_promotion = static_cast<uint8_t>(l2_promotion);
  m.oob_fill = static_cast<uint8_t>(oob_fill);
  m.elem_bytes = static_cast<uint8_t>(eb);
  m.version = kTensorMapVersion;
  m.global_address = ga;
  for (int i = 0; i < 5; ++i) m.element_strides[i] = 1;
  for (uint32_t i = 0; i < rank; ++i) {
    m.global_strides[i] = i == 0 ? eb : global_strides[i - 1];
    m.global_dim[i] = global_dim[i];
    m.box_dim[i] = static_cast<uint16_t>(box_dim[i]);
    m.element_strides[i] = static_cast<uint8_t>(element_strides[i]);
  }
  m.checksum = checksum_of(m);
  memcpy(map128, &m, sizeof m);
  return nullptr;
}

int encode_tiled(void* map128, int data_type, uint32_t rank, void* global_address, const uint64_t* global_dim,
                 const uint64_t* global_strides, const uint32_t* box_dim, const uint32_t* element_strides,
                 int interleave, int swizzle, int l2_promotion, int oob_fill) {
  return encode_tiled_checked(map128, data_type, rank, global_address, global_dim, global_strides, box_dim,
                              element_strides, interleave, swizzle, l2_promotion, oob_fill)
             ? 1
             : 0;
}

const TensorMapInfo* decode(const void* map) {
  if (!map || reinterpret_cast<uintptr_t>(map) % alignof(uint64_t)) return nullptr;
  const TensorMapInfo* m = static_cast<const TensorMapInfo*>(map);
  if (m->magic != kTensorMapMagic || m->version != kTensorMapVersion) return nullptr;
  if (m->checksum != checksum_of(*m)) return nullptr;
  if (m->rank == 0 || m->rank > 5 || m->elem_bytes == 0) return nullptr;
  return m;
}

// Elements loaded along dimension i: ceil(boxDim[i] / elementStrides[i]); dimension 0's element
// stride is ignored without interleave [DRV].
static uint32_t box_elems(const TensorMapInfo& m, uint32_t i) {
  const uint32_t es = i == 0 ? 1 : m.element_strides[i];
  return (m.box_dim[i] + es - 1) / es;
}

uint64_t box_bytes(const TensorMapInfo& m) {
  uint64_t n = m.elem_bytes;
  for (uint32_t i = 0; i < m.rank; ++i) n *= box_elems(m, i);
  return n;
}

uint32_t box_smem_alignment(const TensorMapInfo& m) {
  // [PTX-TMA]: dstMem 128-byte aligned; a swizzled box starts on its pattern's repeat
  // (8 rows of the swizzle span: 256 / 512 / 1024 bytes).
  return m.swizzle == kSwizzleNone ? 128u : 128u * tma_chunks16(m.swizzle);
}

const char* tma_load_box(const TensorMapInfo& m, uint32_t coord_rank, const int32_t* coords, uint8_t* smem,
                         size_t smem_size, uint32_t dst_addr, uint32_t* bytes_out) {
  if (coord_rank != m.rank) return "cp.async.bulk.tensor: the instruction's dimensionality differs from the tensor map's rank";
  if (!coords || !smem) return "cp.async.bulk.tensor: null coordinates or shared memory";
  if (m.interleave != kInterleaveNone) return "cp.async.bulk.tensor: interleaved layouts are not modelled";
  const uint32_t align = box_smem_alignment(m);
  if (dst_addr % align) {
    return m.swizzle == kSwizzleNone ? "cp.async.bulk.tensor: dstMem is not 128-byte aligned"
                                     : "cp.async.bulk.tensor: a swizzled box's dstMem is not aligned to the swizzle "
                                       "pattern (1024 bytes for SWIZZLE_128B)";
  }
  const uint32_t chunks = tma_chunks16(m.swizzle);
  const uint32_t eb = m.elem_bytes;
  const uint32_t n0 = box_elems(m, 0);
  if (chunks > 1 && n0 * eb != chunks * 16)
    return "cp.async.bulk.tensor: a swizzled box whose inner row is narrower than the swizzle span is not modelled";
  const uint64_t bytes = box_bytes(m);
  if (bytes > smem_size || dst_addr > smem_size - bytes) return "cp.async.bulk.tensor: the box lands outside shared memory";

  uint32_t n[5] = {1, 1, 1, 1, 1};
  for (uint32_t i = 0; i < m.rank; ++i) n[i] = box_elems(m, i);
  uint8_t fill[8];
  memset(fill, m.oob_fill == kOobFillNanRequestZeroFma ? 0xFF : 0x00, sizeof fill);
  const uint8_t* global = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(m.global_address));
  uint64_t lin = 0;  // row-major index of the box element, dimension 0 fastest
  uint64_t read = 0;  // bytes taken from global memory (out-of-bounds elements are fills)
  for (uint32_t j4 = 0; j4 < n[4]; ++j4)
    for (uint32_t j3 = 0; j3 < n[3]; ++j3)
      for (uint32_t j2 = 0; j2 < n[2]; ++j2)
        for (uint32_t j1 = 0; j1 < n[1]; ++j1)
          for (uint32_t j0 = 0; j0 < n[0]; ++j0, ++lin) {
            const uint32_t j[5] = {j0, j1, j2, j3, j4};
            bool inside = true;
            uint64_t off = 0;
            for (uint32_t i = 0; i < m.rank; ++i) {
              const int64_t es = i == 0 ? 1 : m.element_strides[i];
              const int64_t g = int64_t(coords[i]) + int64_t(j[i]) * es;
              if (g < 0 || uint64_t(g) >= m.global_dim[i]) {
                inside = false;
                break;
              }
              off += uint64_t(g) * m.global_strides[i];
            }
            const uint32_t a = swizzle_address(static_cast<uint32_t>(dst_addr + lin * eb), chunks);
            memcpy(smem + a, inside ? global + off : fill, eb);
            read += inside ? eb : 0;
          }
  global_access(global, read, Global::Read);
  if (bytes_out) *bytes_out = static_cast<uint32_t>(bytes);
  return nullptr;
}

// ------------------------------------------------------------------------------------------------
// wgmma [PTX-WG].

SmemDesc decode_desc(uint64_t d) {
  // 9.7.15.5.1.2.2: matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4 in bits 0-13, 16-29, 32-45.
  SmemDesc s;
  s.start = static_cast<uint32_t>(d & 0x3FFF) << 4;
  s.lbo = static_cast<uint32_t>((d >> 16) & 0x3FFF) << 4;
  s.sbo = static_cast<uint32_t>((d >> 32) & 0x3FFF) << 4;
  s.base_offset = static_cast<uint32_t>((d >> 49) & 0x7);
  s.swizzle = static_cast<uint32_t>((d >> 62) & 0x3);
  return s;
}

uint64_t encode_desc(const SmemDesc& s) {
  uint64_t d = 0;
  d |= uint64_t((s.start & 0x3FFFF) >> 4);
  d |= uint64_t((s.lbo & 0x3FFFF) >> 4) << 16;
  d |= uint64_t((s.sbo & 0x3FFFF) >> 4) << 32;
  d |= uint64_t(s.base_offset & 7) << 49;
  d |= uint64_t(s.swizzle & 3) << 62;
  return d;
}

const char* operand_address(const SmemDesc& d, bool mn_major, uint32_t mn, uint32_t k, uint32_t* addr) {
  // Descriptor swizzle field: 0 none, 1 128B, 2 64B, 3 32B -> S = span / 16 chunks.
  static const uint32_t kS[4] = {1, 8, 4, 2};
  const uint32_t S = kS[d.swizzle & 3];
  // Base offset: 0 when the swizzle pattern starts on its repeat boundary (1024 / 512 / 256
  // bytes); otherwise (pattern start >> 7) & 7. How the hardware folds a non-zero value into the
  // address is not specified further: refuse rather than guess (valid only when swizzled).
  if (S > 1 && d.base_offset != 0) return "wgmma: a non-zero matrix base offset is not modelled";
  const uint32_t T = 8;  // 16-bit elements per 16 bytes
  uint32_t off;
  if (!mn_major) {
    // K-major ((8,m),(T,2k)):((S*T,SBO),(1, S>1 ? T : LBO)), element units except SBO/LBO (bytes).
    off = (mn % 8) * S * 16 + (mn / 8) * d.sbo + (k % T) * 2 + (k / T) * (S > 1 ? 16 : d.lbo);
  } else if (S > 1) {
    // MN-major swizzled ((T,S,m),(8,k)):((1,T,LBO),(S*T,SBO)).
    off = (mn % T) * 2 + ((mn / T) % S) * 16 + (mn / (T * S)) * d.lbo + (k % 8) * S * 16 + (k / 8) * d.sbo;
  } else {
    // MN-major interleaved ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)).
    off = (mn % T) * 2 + (mn / T) * d.sbo + (k % 8) * 16 + (k / 8) * d.lbo;
  }
  // Swizzle<B,4,3> on the byte address (the table's "swizzling on the previous column").
  *addr = swizzle_address(d.start + off, S);
  return nullptr;
}

namespace {

const char* check_op(const WgmmaOp& op) {
  if (op.n < 8 || op.n > 256 || op.n % 8) return "wgmma: N must be a multiple of 8 in [8, 256]";
  if (op.input != kWgmmaF16 && op.input != kWgmmaBF16) return "wgmma: input type must be f16 or bf16";
  if ((op.scale_a != 1 && op.scale_a != -1) || (op.scale_b != 1 && op.scale_b != -1))
    return "wgmma: imm-scale-a/b must be 1 or -1";
  if ((op.trans_a != 0 && op.trans_a != 1) || (op.trans_b != 0 && op.trans_b != 1))
    return "wgmma: imm-trans-a/b must be 0 or 1";
  if (op.a_regs && op.trans_a) return "wgmma: imm-trans-a does not exist in the register (RS) form";
  return nullptr;
}

// Calls f(address) for each 16-bit element the op reads from shared memory; stops at an error.
template <class F>
const char* for_each_smem_element(const WgmmaOp& op, F&& f) {
  if (!op.a_regs) {
    const SmemDesc da = decode_desc(op.desc_a);
    for (uint32_t m = 0; m < 64; ++m)
      for (uint32_t k = 0; k < 16; ++k) {
        uint32_t a;
        if (const char* e = operand_address(da, op.trans_a == 1, m, k, &a)) return e;
        if (const char* e = f(0, m, k, a)) return e;
      }
  }
  const SmemDesc db = decode_desc(op.desc_b);
  for (uint32_t n = 0; n < uint32_t(op.n); ++n)
    for (uint32_t k = 0; k < 16; ++k) {
      uint32_t a;
      if (const char* e = operand_address(db, op.trans_b == 1, n, k, &a)) return e;
      if (const char* e = f(1, n, k, a)) return e;
    }
  return nullptr;
}

}  // namespace

const char* wgmma_smem_ranges(const WgmmaOp& op, size_t smem_size, std::vector<ByteRange>* out) {
  if (const char* e = check_op(op)) return e;
  std::vector<uint32_t> addrs;
  addrs.reserve(16 * (64 + op.n));
  const char* err = for_each_smem_element(op, [&](int, uint32_t, uint32_t, uint32_t a) -> const char* {
    if (uint64_t(a) + 2 > smem_size) return "wgmma: a matrix descriptor addresses past the end of shared memory";
    addrs.push_back(a);
    return nullptr;
  });
  if (err) return err;
  std::sort(addrs.begin(), addrs.end());
  if (out) {
    out->clear();
    for (uint32_t a : addrs) {
      if (!out->empty() && a <= out->back().end) {
        out->back().end = std::max(out->back().end, a + 2);
      } else {
        out->push_back({a, a + 2});
      }
    }
  }
  return nullptr;
}

const char* wgmma(const WgmmaOp& op, const uint8_t* smem, size_t smem_size, float* const acc[128],
                  const uint32_t (*a_regs)[4]) {
  if (const char* e = check_op(op)) return e;
  if (!acc) return "wgmma: null accumulators";
  if (op.a_regs && !a_regs) return "wgmma: the RS form needs A registers";
  if (!smem) return "wgmma: null shared memory";
  const bool bf16 = op.input == kWgmmaBF16;
  auto load16 = [&](uint16_t h) { return bf16 ? bf16_to_float(h) : f16_to_float(h); };
  const int N = op.n;
  std::vector<float> A(64 * 16), B(16 * size_t(N));  // A[m][k], B[k][n]
  const char* err = for_each_smem_element(op, [&](int which, uint32_t i, uint32_t k, uint32_t a) -> const char* {
    if (uint64_t(a) + 2 > smem_size) return "wgmma: a matrix descriptor addresses past the end of shared memory";
    uint16_t h;
    memcpy(&h, smem + a, 2);
    if (which == 0) {
      A[i * 16 + k] = load16(h);
    } else {
      B[k * N + i] = load16(h);
    }
    return nullptr;
  });
  if (err) return err;
  if (op.a_regs) {
    for (int t = 0; t < 128; ++t)
      for (int j = 0; j < 4; ++j) {
        int r, c;
        a_reg_position(t, j, &r, &c);
        A[r * 16 + c] = load16(static_cast<uint16_t>(a_regs[t][j] & 0xFFFF));      // low half: lower column
        A[r * 16 + c + 1] = load16(static_cast<uint16_t>(a_regs[t][j] >> 16));
      }
  }
  if (op.scale_a < 0)
    for (float& x : A) x = -x;
  if (op.scale_b < 0)
    for (float& x : B) x = -x;
  // D gathered from the fragments, the product computed, the fragments written back.
  std::vector<float> D(64 * size_t(N));
  for (int t = 0; t < 128; ++t) {
    if (!acc[t]) return "wgmma: null accumulator pointer";
    for (int e = 0; e < N / 2; ++e) {
      int r, c;
      acc_position(t, e, &r, &c);
      D[r * N + c] = op.scale_d ? acc[t][e] : 0.0f;
    }
  }
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n) {
      float x = D[m * N + n];
      for (int k = 0; k < 16; ++k) x = fmaf(A[m * 16 + k], B[k * N + n], x);
      D[m * N + n] = x;
    }
  for (int t = 0; t < 128; ++t)
    for (int e = 0; e < N / 2; ++e) {
      int r, c;
      acc_position(t, e, &r, &c);
      acc[t][e] = D[r * N + c];
    }
  return nullptr;
}

// ------------------------------------------------------------------------------------------------
// 16-bit floats.

float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float f;
  if (exp == 0) {
    f = ldexpf(static_cast<float>(man), -24);  // zero or subnormal: man * 2^-24
    uint32_t u;
    memcpy(&u, &f, 4);
    u |= sign;
    memcpy(&f, &u, 4);
    return f;
  }
  uint32_t u = exp == 31 ? (sign | 0x7F800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  memcpy(&f, &u, 4);
  return f;
}

float bf16_to_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_f16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00;  // NaN (quiet)
  if (ax >= 0x477FF000u) return sign | 0x7C00;  // >= 65520: rounds to infinity
  if (ax < 0x38800000u) {                       // below 2^-14: a multiple of 2^-24, rounded to even
    float a;
    memcpy(&a, &ax, 4);
    return sign | static_cast<uint16_t>(nearbyintf(a * 16777216.0f));
  }
  uint32_t h = (ax >> 13) - (112u << 10);
  const uint32_t rest = ax & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return sign | static_cast<uint16_t>(h);
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40);
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
}

}  // namespace sm90
}  // namespace exla_rs_gpusim

extern "C" int exla_rs_gpusim_tensor_map_encode_tiled(void* tensor_map, int data_type, uint32_t rank,
                                                       void* global_address, const uint64_t* global_dim,
                                                       const uint64_t* global_strides, const uint32_t* box_dim,
                                                       const uint32_t* element_strides, int interleave, int swizzle,
                                                       int l2_promotion, int oob_fill) {
  return exla_rs_gpusim::sm90::encode_tiled(tensor_map, data_type, rank, global_address, global_dim, global_strides,
                                            box_dim, element_strides, interleave, swizzle, l2_promotion, oob_fill);
}
