// Data-movement and math models of the Hopper (sm_90a) instructions the sm90 kernels use, for the
// GPU-on-CPU executor (issue 22): tensor maps (cuTensorMapEncodeTiled), the TMA tile load
// (cp.async.bulk.tensor ... .tile) and wgmma.mma_async m64nNk16 (f16/bf16 -> f32, SS and RS).
//
// Pure functions: no runtime, no threads, no timing. The runtime's instruction wrappers call them
// at the moment the ISA says the effect becomes observable (TMA bytes at complete_tx, wgmma
// accumulators at wgmma.wait_group) and do the mbarrier accounting and sanitizer annotations.
//
// Every rule here is taken from NVIDIA's documents, not from our kernels:
//   [DRV]  CUDA Driver API, "Tensor Map Object Management", cuTensorMapEncodeTiled (requirements
//          list and the CUtensorMap* enums).
//   [PTX-TMA]  PTX ISA, cp.async.bulk.tensor (tile mode; dstMem 128-byte aligned) and the
//          tensor swizzling modes; CUDA Programming Guide, TMA swizzle (shared-memory alignment
//          of a swizzled box = the pattern's repeat: 256 / 512 / 1024 bytes for 32B / 64B / 128B).
//   [PTX-WG]  PTX ISA 9.7.15.5.1 "Register Fragments and Shared Memory Matrix Layouts":
//          9.7.15.5.1.1.1 (m64nNk16 fragments of A and D), 9.7.15.5.1.2 (K-major / MN-major and
//          imm-trans-a/b), 9.7.15.5.1.2.1.1-3 (LBO, SBO, canonical layouts with
//          Swizzle<B,4,3> on the byte address), 9.7.15.5.1.2.2 (matrix descriptor format,
//          base offset); 9.7.15.5.2 wgmma.mma_async (scale-d, imm-scale-a/b).
#pragma once
#include <stddef.h>
#include <stdint.h>

#include <vector>

namespace exla_rs_gpusim {
namespace sm90 {

// ------------------------------------------------------------------------------------------------
// Driver enums [DRV], by value.

enum TensorMapDataType : int {
  kU8 = 0, kU16 = 1, kU32 = 2, kI32 = 3, kU64 = 4, kI64 = 5,
  kF16 = 6, kF32 = 7, kF64 = 8, kBF16 = 9, kF32Ftz = 10, kTF32 = 11, kTF32Ftz = 12,
  kPacked16U4Align8B = 13, kPacked16U4Align16B = 14, kPacked16U6Align16B = 15,  // refused: not modelled
};
enum TensorMapInterleave : int { kInterleaveNone = 0, kInterleave16B = 1, kInterleave32B = 2 };
enum TensorMapSwizzle : int {
  kSwizzleNone = 0, kSwizzle32B = 1, kSwizzle64B = 2, kSwizzle128B = 3,
  kSwizzle128BAtom32B = 4, kSwizzle128BAtom32BFlip8B = 5, kSwizzle128BAtom64B = 6,  // refused: not modelled
};
enum TensorMapL2Promotion : int { kL2None = 0, kL2_64B = 1, kL2_128B = 2, kL2_256B = 3 };
enum TensorMapOobFill : int { kOobFillNone = 0, kOobFillNanRequestZeroFma = 1 };

// ------------------------------------------------------------------------------------------------
// Our 128-byte tensor map (the bytes cuTensorMapEncodeTiled would make opaque). Layout, stable:
//   0   magic  'XSTM' (0x4D545358)      4  data_type, rank, interleave, swizzle  (u8 each)
//   8   l2_promotion, oob_fill, elem_bytes, version (u8 each)
//   12  checksum: FNV-1a 32 over the 128 bytes with this field zero (a copied-then-edited or
//       garbage map is refused)
//   16  global_address (u64)
//   24  global_strides[5] (u64, bytes): [0] = elem_bytes, [i] = the driver's globalStrides[i-1]
//   64  global_dim[5] (u64, elements)
//   104 box_dim[5] (u16)                 114 element_strides[5] (u8)     119..127 zero
// Entries past `rank` are zero (dims/boxes) or one (element strides).
struct __attribute__((may_alias)) TensorMapInfo {
  uint32_t magic;
  uint8_t data_type, rank, interleave, swizzle;
  uint8_t l2_promotion, oob_fill, elem_bytes, version;
  uint32_t checksum;
  uint64_t global_address;
  uint64_t global_strides[5];
  uint64_t global_dim[5];
  uint16_t box_dim[5];
  uint8_t element_strides[5];
  uint8_t reserved[9];
};
static_assert(sizeof(TensorMapInfo) == 128, "a CUtensorMap is 128 bytes");

constexpr uint32_t kTensorMapMagic = 0x4D545358u;  // "XSTM" little-endian
constexpr uint8_t kTensorMapVersion = 1;

// cuTensorMapEncodeTiled, same arguments and order [DRV]. Returns nullptr and writes `map128`
// (which must be 64-byte aligned, as the driver requires), or the rule the arguments break
// (the map is left untouched). Beyond the driver's rules, features this model does not implement
// are refused too (interleaved layouts, the packed U4/U6 types, the 128B_ATOM_* swizzles), each
// with a message saying so.
const char* encode_tiled_checked(void* map128, int data_type, uint32_t rank, void* global_address,
                                 const uint64_t* global_dim, const uint64_t* global_strides,
                                 const uint32_t* box_dim, const uint32_t* element_strides, int interleave,
                                 int swizzle, int l2_promotion, int oob_fill);
// Same, as the driver answers: 0 (CUDA_SUCCESS) or 1 (CUDA_ERROR_INVALID_VALUE).
int encode_tiled(void* map128, int data_type, uint32_t rank, void* global_address, const uint64_t* global_dim,
                 const uint64_t* global_strides, const uint32_t* box_dim, const uint32_t* element_strides,
                 int interleave, int swizzle, int l2_promotion, int oob_fill);

// The map at `map` if it is one of ours (8-byte aligned, magic, version, checksum), else nullptr.
const TensorMapInfo* decode(const void* map);

// Bytes one tile load of this map delivers (and counts against the mbarrier's tx-count):
// prod_i ceil(box_dim[i] / element_strides[i]) * elem_bytes, out-of-bounds elements included.
uint64_t box_bytes(const TensorMapInfo& map);

// Shared-memory byte alignment cp.async.bulk.tensor requires of dstMem for this map: 128, or the
// swizzle pattern's repeat (256 / 512 / 1024) when swizzled.
uint32_t box_smem_alignment(const TensorMapInfo& map);

// The swizzle the copy engine and the tensor cores apply to a shared-memory byte address:
// Swizzle<B,4,3> (CuTe notation), i.e. address bits [4, 4+B) ^= bits [7, 7+B), with B = 0, 1, 2, 3
// for none / 32B / 64B / 128B. `chunks16` = swizzle span / 16 = 1, 2, 4, 8.
inline uint32_t swizzle_address(uint32_t addr, uint32_t chunks16) {
  return addr ^ (((addr >> 7) & (chunks16 - 1)) << 4);
}

// cp.async.bulk.tensor.<rank>d.shared::cluster.global.tile: copies the box at `coords`
// (innermost first, elements, signed) of `map` into shared memory at shared-window address
// `dst_addr`, where `smem` is the host memory behind shared address 0 and `smem_size` its size.
// Box element (j0..j4) is tensor element (c_i + j_i * element_strides[i]) (element stride of dim 0
// ignored without interleave [DRV]); it lands at byte dst_addr + (row-major index, dim 0 fastest)
// * elem_bytes, passed through swizzle_address. Elements outside [0, global_dim) in any
// dimension (negative coordinates included) are written as zeros (OOB_FILL_NONE) or as an
// all-ones NaN (NAN_REQUEST_ZERO_FMA; the exact NaN the hardware writes is not documented) and
// still count. Returns nullptr and sets *bytes_out (box_bytes), or an error: coordinate count !=
// map rank, dst misaligned, box outside smem, a swizzled box whose inner row is not the full
// swizzle span (not modelled).
const char* tma_load_box(const TensorMapInfo& map, uint32_t coord_rank, const int32_t* coords, uint8_t* smem,
                         size_t smem_size, uint32_t dst_addr, uint32_t* bytes_out);

// ------------------------------------------------------------------------------------------------
// wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16} [PTX-WG].

// Shared-memory matrix descriptor fields [PTX-WG 9.7.15.5.1.2.2]; addresses and offsets in bytes.
struct SmemDesc {
  uint32_t start;        // bits 0-13 << 4
  uint32_t lbo;          // bits 16-29 << 4: leading dimension byte offset
  uint32_t sbo;          // bits 32-45 << 4: stride dimension byte offset
  uint32_t base_offset;  // bits 49-51
  uint32_t swizzle;      // bits 62-63: 0 none, 1 128B, 2 64B, 3 32B
};
SmemDesc decode_desc(uint64_t desc);
uint64_t encode_desc(const SmemDesc& d);  // the inverse (fields masked to their widths)

enum WgmmaInput : int { kWgmmaF16 = 0, kWgmmaBF16 = 1 };

struct WgmmaOp {
  int n = 64;            // N: a multiple of 8 in [8, 256] (our kernels use 64, 128, 256)
  int input = kWgmmaF16;  // .atype = .btype
  bool a_regs = false;   // RS form: A from four .b32 registers per thread
  uint64_t desc_a = 0;   // SS form only
  uint64_t desc_b = 0;
  int scale_d = 1;       // predicate: 0 -> D = A*B, else D = A*B + D
  int scale_a = 1;       // imm-scale-a: 1 or -1
  int scale_b = 1;       // imm-scale-b: 1 or -1
  int trans_a = 0;       // imm-trans-a (SS only): 0 K-major, 1 M-major
  int trans_b = 0;       // imm-trans-b: 0 K-major, 1 N-major
};

// Shared-memory byte address of the 16-bit element of an operand, per the canonical layouts
// [PTX-WG 9.7.15.5.1.2.1.3] (T = 8 elements of 16 bits = 16 bytes; S = swizzle span / 16):
//   K-major  ((8,m),(T,2k)):((S*T,SBO),(1, S>1 ? T : LBO))   element (mn, k)
//   MN-major ((T,S,m),(8,k)):((1,T,LBO),(S*T,SBO)) swizzled, ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)) not
// then Swizzle<B,4,3> on the byte address. Returns nullptr or an error (unmodelled base offset,
// a reserved swizzle encoding).
const char* operand_address(const SmemDesc& d, bool mn_major, uint32_t mn, uint32_t k, uint32_t* addr);

// The register fragment rules [PTX-WG 9.7.15.5.1.1.1], thread t of the warpgroup (0..127):
// accumulator element e (0 .. N/2-1) is D[row][col] with row = 16 (t/32) + (t%32)/4 + 8 ((e/2)%2),
// col = 8 (e/4) + 2 (t%4) + e%2; A register j (0..3) holds A[row][col], A[row][col+1] (low half
// first) with row = 16 (t/32) + (t%32)/4 + 8 (j%2), col = 2 (t%4) + 8 (j/2).
inline void acc_position(int t, int e, int* row, int* col) {
  *row = 16 * (t / 32) + (t % 32) / 4 + 8 * ((e / 2) % 2);
  *col = 8 * (e / 4) + 2 * (t % 4) + e % 2;
}
inline void a_reg_position(int t, int j, int* row, int* col) {
  *row = 16 * (t / 32) + (t % 32) / 4 + 8 * (j % 2);
  *col = 2 * (t % 4) + 8 * (j / 2);
}

struct ByteRange {
  uint32_t begin, end;  // [begin, end) in shared-window addresses
};

// Shared-memory bytes the op reads (merged, ascending): A's (SS) and B's elements. Returns nullptr,
// or an error for an invalid op or a descriptor addressing past smem_size.
const char* wgmma_smem_ranges(const WgmmaOp& op, size_t smem_size, std::vector<ByteRange>* out);

// Executes the op for the whole warpgroup: acc[t] points to thread t's N/2 f32 accumulators,
// a_regs[t] to its four A registers (RS only; may be null for SS). Arithmetic, per output element:
// x = scale_d ? D : +0; then for k = 0..15 ascending x = fmaf(sa*A[m][k], sb*B[k][n], x) in IEEE
// f32 (16-bit products are exact in f32, except bf16 products beyond f32's range; so each step
// rounds once, at the addition). The ISA leaves the tensor core's internal order and precision
// unspecified: a GPU may differ by a few ulps. Returns nullptr or the same errors as
// wgmma_smem_ranges (nothing is written then).
const char* wgmma(const WgmmaOp& op, const uint8_t* smem, size_t smem_size, float* const acc[128],
                  const uint32_t (*a_regs)[4]);

// 16-bit float decoding (IEEE binary16 with subnormals, bfloat16) and round-to-nearest-even
// encoding, as cvt.rn does.
float f16_to_float(uint16_t h);
float bf16_to_float(uint16_t h);
uint16_t float_to_f16(float f);
uint16_t float_to_bf16(float f);

}  // namespace sm90
}  // namespace exla_rs_gpusim
