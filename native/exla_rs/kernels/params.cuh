// The argument block every exla_rs attention kernel takes, passed by value as its only parameter.
// Mirrored field for field by `#[repr(C)]` structs in crates/exla-rs-cuda/src/params.rs: change both.
#pragma once

namespace exla_rs {

// The contract's optional operands (docs/flash-attention-contract.md), the same block in both
// passes. A null pointer means the operand is absent; the kernels test the pointer, nothing else.
struct ExtraParams {
  const void* key_mask;         // [B, Sk], integer of key_mask_bytes bytes, nonzero = visible
  const void* bias;             // [Bb, Hb, Sqb, Skb] of bias_dtype, read through the strides below
  const float* alibi_slopes;    // f32[H]: z += -slope[h] * |q_start[b] + i - j|
  const unsigned* dropout_key;  // u32[2] (device memory): the Philox key (k0, k1)
  long long bias_stride_b;      // in elements; 0 on a broadcast dimension
  long long bias_stride_h;
  long long bias_stride_q;
  long long bias_stride_k;
  int key_mask_bytes;           // 1, 2, 4 or 8 (0 without key_mask)
  int bias_dtype;               // 0 = f32, 1 = f16, 2 = bf16
  unsigned dropout_threshold;   // keep iff draw >= threshold = floor(rate * 2^32)
  float dropout_scale;          // 1 / (1 - rate), rounded to f32 on the host
};

// Forward: q [B,Sq,H,D], k/v [B,Sk,Hkv,D], o like q, lse f32 [B,H,Sq].
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  const int* kv_len;   // s32[B]
  const int* q_start;  // s32[B]
  void* o;
  float* lse;
  int batch, seq_q, seq_k, heads, kv_heads, head_dim;
  float scale;
  float softcap;  // 0 = off
  long long window_left;   // < 0 = unbounded
  long long window_right;  // < 0 = unbounded, 0 = causal
  float softcap_inv;       // 1 / softcap, 0 when off (kernels multiply: no device division)
  ExtraParams x;
};

// The split-KV forward (flash_fwd_split.cuh, issue 34): the call's FwdParams plus the split count and
// the f32 partials in XLA's workspace (row (split, b, h, i), in lse order); the combine pass takes
// the same block. With num_splits = 1 the split kernel writes o / lse itself and the partials are null.
struct SplitParams {
  FwdParams f;
  float* o_part;    // f32 [num_splits, B, H, Sq, D]: each split's o, normalised by its own row sum
  float* lse_part;  // f32 [num_splits, B, H, Sq]: each split's lse (-inf where it saw no key)
  int num_splits;
  int row_blocks;   // ceil(H / Hkv * Sq / kBlockM): grid.x = row_blocks * num_splits
};

// Backward: the forward's operands plus o, lse, do; results dq/dk/dv and two f32 scratch arrays in
// XLA's workspace: delta [B,H,Sq] = rowsum(do * o), and (tensor-core path) dq_accum [B,Sq,H,D].
struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const int* kv_len;
  const int* q_start;
  const void* o;
  const float* lse;
  const void* d_o;
  void* dq;
  void* dk;
  void* dv;
  float* delta;
  float* dq_accum;  // null when the kernel writes dq directly (SIMT path)
  int batch, seq_q, seq_k, heads, kv_heads, head_dim;
  float scale;
  float softcap;
  long long window_left;
  long long window_right;
  float softcap_inv;
  ExtraParams x;
  // bias_grad: dbias is accumulated in f32 (red.add) in the workspace, laid out densely like the
  // bias (index b*stride_b + h*stride_h + i*stride_q + j*stride_k), then rounded once into dbias.
  float* dbias_accum;   // null without bias_grad
  void* dbias;          // the result, of bias_dtype
  long long dbias_elems;
  // The tensor-core backward's blocks with blockIdx.x < kb_first return at once. 0 for the one
  // launch of every key block; the deterministic mode (EXLA_RS_DETERMINISTIC, launch.rs) runs key
  // block r of every (kv head, batch) alone in launch r (grid.x = r + 1, kb_first = r), so the
  // atomics of dQ into one element follow the key blocks' order. (An offset added to blockIdx.x
  // instead cost the D = 192 key loops 0.1 instructions per HMMA and two sets 8 bytes of spills:
  // the compiler no longer re-reads the block index where it needs it.)
  int kb_first;
  int unused;
};

// The pad kernel's block (pad.cuh): head dims without a kernel run on the next kernel head dim
// with zero-padded copies of their operands and results in the workspace.
struct PadParams {
  const void* src;  // [rows, src_cols] elements
  void* dst;        // [rows, dst_cols] elements
  long long rows;
  int src_cols;
  int dst_cols;
  int copy_cols;    // columns copied; dst columns [copy_cols, dst_cols) are written 0
  int unused;
};

}  // namespace exla_rs

// The Rust mirror checks the same numbers (crates/exla-rs-cuda/src/params.rs).
static_assert(sizeof(exla_rs::ExtraParams) == 80, "ExtraParams layout changed: update params.rs");
static_assert(sizeof(exla_rs::FwdParams) == 192, "FwdParams layout changed: update params.rs");
static_assert(sizeof(exla_rs::BwdParams) == 272, "BwdParams layout changed: update params.rs");
static_assert(sizeof(exla_rs::SplitParams) == 216, "SplitParams layout changed: update params.rs");
static_assert(sizeof(exla_rs::PadParams) == 40, "PadParams layout changed: update params.rs");
