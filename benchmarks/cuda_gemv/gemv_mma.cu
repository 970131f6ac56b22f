// Prototype (benchmark only): a few-row GEMV whose weight tiles go straight from global memory into tensor-core
// operands, with no shared-memory pipeline. Out[m, n] = sum_k X[m, k] * W[n, k] for m < M <= 8, bf16 in, fp32
// accumulation, bf16 out.
//
// Why: the Triton six-row kernel (kernels/gemv.py, _gemv_dot) streams its weights through a cp.async pipeline in
// shared memory, one 4-warp program per SM, and runs 3-6% slower than the one-row CUDA-core kernel, which keeps
// 16 warps per SM with their loads in registers. Here each warp keeps UNROLL x 2 x TILES 16-byte weight loads in
// flight in registers, like the one-row kernel, and feeds them to mma.sync.m16n8k16 as they arrive.
//
// Operands: mma.m16n8k16's A is 16 weight rows (output columns) x 16 k, its B is 16 k x 8 x-rows. A lane
// (group g = lane / 4, quad q = lane % 4) holds A(g, 2q..2q+1), A(g+8, 2q..2q+1), A(g, 2q+8..9), A(g+8, 2q+8..9)
// and B(2q..2q+1, g), B(2q+8..9, g). A dot product does not depend on the order of its k, so each 32-wide k chunk
// is relabelled: lane q's virtual k {2q, 2q+1, 2q+8, 2q+9} of the first MMA are the physical k 8q..8q+3 of the
// chunk, those of the second MMA are 8q+4..8q+7. One 16-byte load per weight row then fills a lane's operands of
// both MMAs, and x is relabelled the same way (one 16-byte load per x row). A row's result depends on its own x row
// only (the MMA computes each output from its own A row and B column), so rows are batch-invariant.
//
// Work split: a block owns 16 * TILES output columns; its WARPS warps split K into contiguous slices and their
// partial tiles are added in warp order through shared memory (a fixed order: deterministic).
#include <cuda_bf16.h>
#include <stdint.h>

// Plain intrinsics rather than asm volatile, so the compiler may hoist every load of an unrolled batch ahead of
// the MMAs that consume them.
__device__ __forceinline__ uint4 load_stream(const __nv_bfloat16* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ uint4 load_cached(const __nv_bfloat16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int TILES, int WARPS, int UNROLL>
__device__ __forceinline__ void gemv_mma(const __nv_bfloat16* __restrict__ X, const __nv_bfloat16* __restrict__ W,
                                         __nv_bfloat16* __restrict__ Out, int M, int K, int ldx, int ldo, int pdl) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int n0 = blockIdx.x * 16 * TILES;
  const int kslice = K / WARPS;
  const int kbeg = warp * kslice;
  const __nv_bfloat16* wp[2 * TILES];
#pragma unroll
  for (int t = 0; t < 2 * TILES; ++t) wp[t] = W + (size_t)(n0 + 8 * t + g) * K + kbeg + 8 * q;
  const bool xrow = g < M;
  const __nv_bfloat16* xp = X + (size_t)(xrow ? g : 0) * ldx + kbeg + 8 * q;
  if (pdl) {
#pragma unroll
    for (int t = 0; t < 2 * TILES; ++t) asm volatile("prefetch.global.L2 [%0];" ::"l"(wp[t]));
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
  }
  float acc[TILES][4];
#pragma unroll
  for (int t = 0; t < TILES; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  // Register double buffering: the next UNROLL steps' loads are issued before this batch's MMAs, so UNROLL steps of
  // weights are always in flight (the compiler interleaves a single batch's loads with its MMAs otherwise).
  const int batches = kslice / (32 * UNROLL);  // the launcher checks K % (32 * WARPS * UNROLL) == 0
  uint4 a[2][UNROLL][2 * TILES], b[2][UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
    for (int t = 0; t < 2 * TILES; ++t) a[0][u][t] = load_stream(wp[t] + u * 32);
    b[0][u] = xrow ? load_cached(xp + u * 32) : make_uint4(0, 0, 0, 0);
  }
  for (int i = 0; i < batches; i += 2) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // constant buffer indices: the arrays stay in registers
      const int cur = half, nxt = 1 - half;
      if (i + half >= batches) break;
      if (i + half + 1 < batches) {
        const int s = (i + half + 1) * UNROLL;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
          for (int t = 0; t < 2 * TILES; ++t) a[nxt][u][t] = load_stream(wp[t] + (s + u) * 32);
          b[nxt][u] = xrow ? load_cached(xp + (s + u) * 32) : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int t = 0; t < TILES; ++t) {
          const uint4 lo = a[cur][u][2 * t], hi = a[cur][u][2 * t + 1];  // weight rows g and g + 8 of tile t
          mma16816(acc[t], lo.x, hi.x, lo.y, hi.y, b[cur][u].x, b[cur][u].y);
          mma16816(acc[t], lo.z, hi.z, lo.w, hi.w, b[cur][u].z, b[cur][u].w);
        }
      }
    }
  }
  // D fragment: acc[t][0..1] = (column n0 + 16t + g, x rows 2q, 2q+1), acc[t][2..3] = (column + 8, same rows)
  __shared__ float part[WARPS][TILES * 4][32];
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) part[warp][t * 4 + i][lane] = acc[t][i];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int t = 0; t < TILES; ++t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float sum = part[0][t * 4 + i][lane];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) sum += part[w][t * 4 + i][lane];
        const int row = 2 * q + (i & 1), col = n0 + 16 * t + g + 8 * (i >> 1);
        if (row < M) Out[(size_t)row * ldo + col] = __float2bfloat16_rn(sum);
      }
    }
  }
}

#define INSTANCE(T, WP, U)                                                                                          \
  extern "C" __global__ void __launch_bounds__(WP * 32)                                                              \
      gemv_mma_t##T##_w##WP##_u##U(const __nv_bfloat16* X, const __nv_bfloat16* W, __nv_bfloat16* Out, int M,     \
                                   int K, int ldx, int ldo, int pdl) {                                               \
    gemv_mma<T, WP, U>(X, W, Out, M, K, ldx, ldo, pdl);                                                              \
  }

INSTANCE(1, 4, 4)
INSTANCE(1, 4, 8)
INSTANCE(1, 8, 4)
INSTANCE(1, 8, 8)
INSTANCE(1, 16, 4)
INSTANCE(2, 4, 4)
INSTANCE(2, 8, 4)
INSTANCE(4, 8, 2)
