// The argument block every exla_rs attention kernel takes, passed by value as its only parameter.
// Mirrored field for field by `#[repr(C)]` structs in crates/exla-rs-cuda/src/params.rs: change both.
#pragma once

namespace exla_rs {

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
};

}  // namespace exla_rs

// The Rust mirror checks the same numbers (crates/exla-rs-cuda/src/params.rs).
static_assert(sizeof(exla_rs::FwdParams) == 112, "FwdParams layout changed: update params.rs");
static_assert(sizeof(exla_rs::BwdParams) == 160, "BwdParams layout changed: update params.rs");
