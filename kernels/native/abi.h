// The native decode step's C ABI: plain structures of pointers into tensors that Python owns, mirrored field for
// field by the ctypes structures in kernels/cpu_native.py (its ABI_VERSION and rs_abi_version change together),
// and the bounds. The kernel trusts every index it is given: Python checks each against its buffer before the
// call (model/native_decode.py, kernels/bounds.py), and rs_check the model's shapes once.
#pragma once

#include <cstdint>

extern "C" {
struct Linear {
  int32_t format, n, k;
  int32_t parts;       // kParts: how many quantized Linear w points to, their rows one after another; else 0
  const void* w;       // dense: T, packed in blocks of 16 rows (see product)
  const void* scale;   // quantized formats: per-block scales; else null
  const void* zero;    // quantized formats: per-block offsets; else null
  const void* bias;    // T [n] or null
  const void* super_scale;  // K-quant formats: fp16 [n/16][k/256][16], the super-block's d; else null
  const void* super_zero;   // kQ4K, kQ5K: fp16 [n/16][k/256][16], the super-block's -dmin; else null
};
struct Layer {
  const void* ln1;
  const void* ln2;
  Linear qkv, o, gate_up, down;
  void* k_pool;  // T [slots, kv_heads, head_dim]; 8-bit codes (uint8) when Model.kv_codes is set
  void* v_pool;
  float* k_scale;  // 8-bit codes: float [slots, kv_heads], a head's value = code's value * scale; else null
  float* v_scale;
};
struct Model {
  int32_t bf16, layers, hidden, heads, kv_heads, head_dim, inter, vocab;
  int32_t amx;  // 1: bf16 products use AMX tiles (rs_request_amx granted them); 0: AVX-512
  float eps, scale;
  const Layer* layer;
  const void* norm;
  Linear lm_head;
  int32_t kv_codes;  // 0: the pools hold T; kInt8Codes, kE4M3Codes, kE5M2Codes: 8-bit codes (model/kv_codes.py)
  int32_t kv_top;    // fp8 codes: the largest finite positive code (codes 0 .. kv_top increase in value)
  float kv_limit;    // the magnitude a head's largest value is scaled to
  float pad;
  const float* kv_values;  // [256]: what each code byte stands for
};
struct Step {
  int32_t rows, logit_rows;
  int32_t groups, pad;      // decode: sets of rows whose contexts start with the same slots (shared prefixes)
  const int32_t* group_rows;    // [rows]: the rows of group 0, then of group 1, ... (rows in no group: not listed)
  const int32_t* group_start;   // [groups + 1]: group g's rows are group_rows[group_start[g] .. group_start[g + 1])
  const int32_t* group_shared;  // [groups]: group g's run of leading context slots (read from its first row's)
  const int32_t* row_shared;    // [rows]: how many of its group's run a row sees (the whole run, or fewer: one
                                // request's rows scoring their own earlier slots through the group, causally;
                                // at least 1), else 0
  void* h;                  // T [rows, hidden]: the embeddings in, the last layer's output out
  const void* cos;          // T [rows, head_dim]
  const void* sin;          // T [rows, head_dim] (the rotate-half sign folded in, as RopeTable keeps it)
  const int64_t* out_slot;  // [rows]: where each row's new K/V goes
  const int64_t* slots;     // the rows' context slots (each row's new one included)
  const int64_t* starts;    // [rows]: row m's context is slots[starts[m] .. starts[m] + lens[m]) -- a request's
  const int64_t* lens;      // [rows]   row in decode; in a prefill each token's prefix of its request's row
  const int64_t* logit_row; // [logit_rows]
  float* logits;            // [logit_rows, vocab]
  void* scratch;            // rs_scratch_bytes(model, rows, groups, sum of group_shared), sized in the thread
  int64_t scratch_bytes;    // that runs the step with its thread count: a step refuses a smaller one (code 3)
};
}

namespace rs {

inline int64_t row_start(const Step& st, int m) { return st.starts[m]; }
inline int row_len(const Step& st, int m) { return int(st.lens[m]); }

constexpr int kDense = 0, kQ8 = 1, kQ4 = 2, kQ8G16 = 3, kQ4K = 4, kQ6K = 5, kParts = 6, kQ5 = 7, kQ5K = 8,
              kQ8H = 9;  // Linear.format
constexpr bool k_quant(int format) { return format == kQ4K || format == kQ5K || format == kQ6K; }  // k per 256
constexpr bool byte_quant(int format) { return format == kQ8 || format == kQ8H || format == kQ8G16; }  // a byte a weight
constexpr int kInt8Codes = 1, kE4M3Codes = 2, kE5M2Codes = 3;  // Model.kv_codes
constexpr int kBlock = 32;                   // weights per quantization block (along k)
constexpr int kSuper = 256;                  // weights per K-quant super-block (along k)
constexpr int kMaxGroup = 16;                // query heads per kv head
constexpr int kMaxHeadDim = 256;

}  // namespace rs
