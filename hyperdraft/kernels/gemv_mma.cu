// Few-row GEMV on tensor cores fed straight from global memory (2..16 rows: a chain or tree verify, a draft
// catch-up). Out[m, n] = X[m, :] . W[n, :] (+ bias[n]) (+ residual[m, n]) for m < M <= 16; bf16 or fp16 operands,
// fp32 accumulation. Built by kernels/cuda_kernels.py with nvcc, launched through the driver API.
//
// Why not Triton's tl.dot: it stages weight tiles through a cp.async pipeline in shared memory, which leaves one
// 4-warp program per SM and streams 3-6% slower than the one-row CUDA-core kernel (benchmarks/results/
// gemv_shapes_h100.md). Here every lane keeps 2 x UNROLL 16-byte weight loads in flight in registers (double
// buffered across UNROLL-step batches, like the one-row kernel's wide loads) and hands them to mma.sync.m16n8k16.
//
// Operands: the MMA's A is 16 weight rows (output columns) x 16 k, its B is 16 k x 8 x-rows. A lane (g = lane / 4,
// q = lane % 4) holds A(g, 2q..2q+1), A(g+8, 2q..2q+1), A(g, 2q+8..9), A(g+8, 2q+8..9) and B(2q..2q+1, g),
// B(2q+8..9, g). A dot product is the same sum in any order of its k, so each 32-wide k chunk is relabelled: lane q's
// k of the first MMA are the physical k 8q..8q+3 of the chunk, those of the second MMA 8q+4..8q+7. One 16-byte load
// per weight row fills a lane's operands of both MMAs; x rows are read with the same relabelling.
//
// Batch invariance: an output element depends only on its own weight row and x row (the MMA forms each output from
// one A row and one B column; rows 8..15 are a second MMA over the same A), the K split and the summation order
// depend on K alone, so a row's result is the same in any call of 2..16 rows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

template <typename T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 round(float v) { return __float2bfloat16_rn(v); }
};

template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half round(float v) { return __float2half_rn(v); }
};

// Intrinsics, not asm volatile, so the compiler may issue a whole batch of loads ahead of its MMAs. x and the
// residual are written by the kernel before this one, which may still be running when this grid starts (PDL): they
// are read through L2 (ld.global.cg), never through the non-coherent read-only path that __ldg or a const
// __restrict__ pointer would select (it can return lines cached before the writer finished).
template <typename T>
__device__ __forceinline__ uint4 load_weights(const T* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }

template <typename T>
__device__ __forceinline__ uint4 load_x(const T* p, bool valid) {
  return valid ? __ldcg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
}

// GROUPS x-row groups of 8 (rows 0-7, 8-15); WARPS warps split K; UNROLL 32-wide k chunks per load batch.
template <typename T, int GROUPS, int WARPS, int UNROLL>
__device__ __forceinline__ void gemv_mma(const T* X, const T* __restrict__ W, const T* __restrict__ Bias, const T* Res,
                                         void* Out, int M, int K, int ldx, int ldr, int ldo, int flags) {
  const bool has_bias = flags & 1, has_res = flags & 2, out_f32 = flags & 4, pdl = flags & 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int n0 = blockIdx.x * 16;
  const int kslice = K / WARPS;  // the host checks K % (32 * WARPS * UNROLL) == 0
  const int kbeg = warp * kslice;
  const T* w_lo = W + (size_t)(n0 + g) * K + kbeg + 8 * q;  // weight rows g and g + 8 of the block's 16
  const T* w_hi = w_lo + (size_t)8 * K;
  const T* xp[GROUPS];
  bool xrow[GROUPS];
#pragma unroll
  for (int j = 0; j < GROUPS; ++j) {
    xrow[j] = 8 * j + g < M;
    xp[j] = X + (size_t)(xrow[j] ? 8 * j + g : 0) * ldx + kbeg + 8 * q;
  }
#if __CUDA_ARCH__ >= 900
  if (pdl) {  // weights never depend on the previous kernel: ask L2 for the first ones, then wait for its results
    asm volatile("prefetch.global.L2 [%0];" ::"l"(w_lo));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(w_hi));
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
#endif
  float acc[GROUPS][4];
#pragma unroll
  for (int j = 0; j < GROUPS; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const int batches = kslice / (32 * UNROLL);
  uint4 a[2][UNROLL][2], b[2][UNROLL][GROUPS];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    a[0][u][0] = load_weights(w_lo + u * 32);
    a[0][u][1] = load_weights(w_hi + u * 32);
#pragma unroll
    for (int j = 0; j < GROUPS; ++j) b[0][u][j] = load_x(xp[j] + u * 32, xrow[j]);
  }
  for (int i = 0; i < batches; i += 2) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // constant buffer indices keep both buffers in registers
      const int cur = half, nxt = 1 - half;
      if (i + half >= batches) break;
      if (i + half + 1 < batches) {  // the next batch's loads go out before this batch's MMAs
        const int s = (i + half + 1) * UNROLL * 32;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          a[nxt][u][0] = load_weights(w_lo + s + u * 32);
          a[nxt][u][1] = load_weights(w_hi + s + u * 32);
#pragma unroll
          for (int j = 0; j < GROUPS; ++j) b[nxt][u][j] = load_x(xp[j] + s + u * 32, xrow[j]);
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const uint4 lo = a[cur][u][0], hi = a[cur][u][1];
#pragma unroll
        for (int j = 0; j < GROUPS; ++j) {
          Mma<T>::run(acc[j], lo.x, hi.x, lo.y, hi.y, b[cur][u][j].x, b[cur][u][j].y);
          Mma<T>::run(acc[j], lo.z, hi.z, lo.w, hi.w, b[cur][u][j].z, b[cur][u][j].w);
        }
      }
    }
  }
  // acc[j][0..1]: column n0 + g, x rows 8j + 2q + {0, 1}; acc[j][2..3]: column n0 + g + 8, the same rows.
  // The warps' K slices are added in warp order (deterministic).
  __shared__ float part[WARPS][GROUPS * 4][32];
#pragma unroll
  for (int j = 0; j < GROUPS; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) part[warp][j * 4 + e][lane] = acc[j][e];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int j = 0; j < GROUPS; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 8 * j + 2 * q + (e & 1), col = n0 + g + 8 * (e >> 1);
        if (row >= M) continue;
        float v = part[0][j * 4 + e][lane];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) v += part[w][j * 4 + e][lane];
        if (has_bias) v += Mma<T>::to_float(Bias[col]);
        // the product rounds to the activation dtype before the residual joins it, as eager torch rounds it
        if (has_res) v = Mma<T>::to_float(Mma<T>::round(v)) + Mma<T>::to_float(__ldcg(Res + (size_t)row * ldr + col));
        const T out = Mma<T>::round(v);
        if (out_f32) {
          reinterpret_cast<float*>(Out)[(size_t)row * ldo + col] = Mma<T>::to_float(out);
        } else {
          reinterpret_cast<T*>(Out)[(size_t)row * ldo + col] = out;
        }
      }
    }
  }
}

#define GEMV_MMA(NAME, T, GROUPS, WARPS, UNROLL)                                                                   \
  extern "C" __global__ void __launch_bounds__(WARPS * 32)                                                         \
      NAME(const T* X, const T* W, const T* Bias, const T* Res, void* Out, int M, int K, int ldx, int ldr, int ldo, \
           int flags) {                                                                                            \
    gemv_mma<T, GROUPS, WARPS, UNROLL>(X, W, Bias, Res, Out, M, K, ldx, ldr, ldo, flags);                           \
  }

// Rows 2..8 (one x group) and 9..16 (two): the same K split (4 warps), so a row's sums do not depend on which runs.
GEMV_MMA(gemv_mma_bf16_rows8, __nv_bfloat16, 1, 4, 8)
GEMV_MMA(gemv_mma_bf16_rows16, __nv_bfloat16, 2, 4, 4)
GEMV_MMA(gemv_mma_f16_rows8, __half, 1, 4, 8)
GEMV_MMA(gemv_mma_f16_rows16, __half, 2, 4, 4)
