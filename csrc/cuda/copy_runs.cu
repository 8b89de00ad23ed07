/* reshard CUDA: copy a whole descriptor table in one launch, with fused casts.
 *
 * Work space: the table flattened in (row, c, j) order, as in the C core; work element k
 * is one destination element. Each warp takes a tile of 32 * U * V consecutive work
 * elements (V = elements per 16-byte access of the narrower dtype, U groups per lane in
 * flight: tile_elems), finds the rows the tile spans with one binary search over the prefix array,
 * and then each lane maps its own groups to rows inside that (usually one-row) range.
 * A group whose V elements sit in one run at 16-byte-aligned addresses on both sides
 * moves with 16-byte loads/stores (two of them on the wider side of a cast); any other
 * group moves element by element. Casts are the C core's own (../casts.h): torch's CPU .to().
 * No torch headers: this file compiles with plain `nvcc -c -std=c++17 -arch=sm_90`.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "../casts.h"
#include "cuda_check.h"
#include "reshard_cuda.h"

namespace {

/* Element kinds: the storage type of each; casts exist among F32, BF16, F16. */
enum Kind { K_F32, K_BF16, K_F16, K_RAW1, K_RAW2, K_RAW4, K_RAW8 };

template <int K>
struct Store;
template <>
struct Store<K_F32> {
  typedef uint32_t T;
};
template <>
struct Store<K_BF16> {
  typedef uint16_t T;
};
template <>
struct Store<K_F16> {
  typedef uint16_t T;
};
template <>
struct Store<K_RAW1> {
  typedef uint8_t T;
};
template <>
struct Store<K_RAW2> {
  typedef uint16_t T;
};
template <>
struct Store<K_RAW4> {
  typedef uint32_t T;
};
template <>
struct Store<K_RAW8> {
  typedef uint64_t T;
};

/* Same kind: raw bits. */
template <int SK, int DK>
struct Cast {
  __device__ __forceinline__ static typename Store<DK>::T run(typename Store<SK>::T x) { return x; }
};
#define RS_CAST(SK, DK, EXPR)                                                              \
  template <>                                                                              \
  struct Cast<SK, DK> {                                                                    \
    __device__ __forceinline__ static typename Store<DK>::T run(typename Store<SK>::T x) { \
      return EXPR;                                                                         \
    }                                                                                      \
  };
RS_CAST(K_F32, K_BF16, rs_bf16_from_f32_bits(x))
RS_CAST(K_F32, K_F16, rs_f16_from_f32_bits(x))
RS_CAST(K_BF16, K_F32, (uint32_t)x << 16)
RS_CAST(K_F16, K_F32, rs_f32_bits_from_f16(x))
RS_CAST(K_BF16, K_F16, rs_f16_from_f32_bits((uint32_t)x << 16))
RS_CAST(K_F16, K_BF16, rs_bf16_from_f16_bits(x))
#undef RS_CAST

/* ---- the kernel ---------------------------------------------------------------------- */

struct Params {
  const char *src;
  char *dst;
  const rs_run *runs;
  const int64_t *prefix;
  int64_t n;
  int64_t begin, end;
  int mode; /* rs_mode */
};

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
/* Tables averaging at most this many source bytes per row take the short-run kernel. */
constexpr int64_t kShortRowBytes = 2048;

/* Tile geometry of a dtype pair (element sizes in bytes), for the kernel's loop and the
 * launch's grid alike. A group is V elements, one 16-byte access on the narrower side (two on
 * the wider side of a cast); each lane keeps 2 * kUnroll 16-byte loads in flight, so U groups;
 * a warp's tile is 32 lanes x U groups x V elements. */
__host__ __device__ constexpr int group_elems(int src_size, int dst_size) {
  return 16 / (src_size < dst_size ? src_size : dst_size);
}
__host__ __device__ constexpr int groups_per_lane(int src_size, int dst_size) {
  return kUnroll * 2 /
         (group_elems(src_size, dst_size) * (src_size > dst_size ? src_size : dst_size) / 16);
}
__host__ __device__ constexpr int64_t tile_elems(int src_size, int dst_size) {
  return (int64_t)32 * groups_per_lane(src_size, dst_size) * group_elems(src_size, dst_size);
}

/* Largest r in [lo, hi) with prefix[r] <= pos; prefix[lo] <= pos must hold. Since
 * pos < prefix[hi], the answer is a non-empty row. */
__device__ __forceinline__ int64_t find_row(const int64_t *__restrict__ prefix, int64_t lo,
                                            int64_t hi, int64_t pos) {
  while (hi - lo > 1) {
    int64_t mid = lo + ((hi - lo) >> 1);
    if (__ldg(prefix + mid) <= pos)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

/* Run index c and element j inside the run of work offset e within a row. */
__device__ __forceinline__ void split_offset(int64_t e, int64_t len, int64_t &c, int64_t &j) {
  if (e < len) {
    c = 0;
    j = e;
  } else if (e <= 0xFFFFFFFFll) { /* then len < 2^32 too: 32-bit division is far cheaper */
    uint32_t q = (uint32_t)e / (uint32_t)len;
    c = q;
    j = e - (int64_t)q * len;
  } else {
    c = e / len;
    j = e - c * len;
  }
}

/* Element indices (in each side's dtype) of work element k in row r. */
__device__ __forceinline__ void locate(const Params &p, const rs_run &row, int64_t row_start,
                                       int64_t k, int64_t &si, int64_t &di, int64_t &left) {
  int64_t c, j;
  split_offset(k - row_start, row.length, c, j);
  si = p.mode == RS_MODE_UNPACK ? k - p.begin : row.src_offset + c * row.src_stride + j;
  di = p.mode == RS_MODE_PACK ? k - p.begin : row.dst_offset + c * row.dst_stride + j;
  left = row.length - j; /* elements left in this run */
}

__device__ __forceinline__ rs_run load_row(const rs_run *runs, int64_t r) {
  const longlong2 *q = reinterpret_cast<const longlong2 *>(runs + r);
  longlong2 a = __ldg(q), b = __ldg(q + 1), c = __ldg(q + 2);
  rs_run row;
  row.src_offset = a.x;
  row.src_stride = a.y;
  row.dst_offset = b.x;
  row.dst_stride = b.y;
  row.length = c.x;
  row.count = c.y;
  return row;
}

/* Element-by-element copy of work [k, kend) starting in row r (groups that cross a run or a
 * row, or are misaligned). */
template <int SK, int DK>
__device__ __noinline__ void copy_scalar(const Params &p, int64_t r, int64_t k, int64_t kend) {
  typedef typename Store<SK>::T S;
  typedef typename Store<DK>::T D;
  const S *__restrict__ src = reinterpret_cast<const S *>(p.src);
  D *__restrict__ dst = reinterpret_cast<D *>(p.dst);
  int64_t rstart = __ldg(p.prefix + r), rend = __ldg(p.prefix + r + 1);
  rs_run cur = load_row(p.runs, r);
  for (int64_t kk = k; kk < kend; ++kk) {
    if (kk >= rend) {
      do {
        ++r;
        rend = __ldg(p.prefix + r + 1);
      } while (kk >= rend);
      rstart = __ldg(p.prefix + r);
      cur = load_row(p.runs, r);
    }
    int64_t s1, d1, l1;
    locate(p, cur, rstart, kk, s1, d1, l1);
    dst[d1] = Cast<SK, DK>::run(src[s1]);
  }
}

/* Short-run tiles (at most 32 rows): lane i loads row rlo + i with the prefix entries, the
 * rows go to warp-private shared memory, every group of the lane resolves its row there (no
 * global load between the tile's start and its data loads), all U data loads are issued as
 * asynchronous copies into the warp's shared staging before the first store (no registers
 * held across them), and groups that cross a run or are misaligned are copied element by
 * element afterwards. Where the kernel has the registers for it (two_tiles), each warp keeps
 * two short tiles in flight: the next tile's rows and loads are issued before the previous
 * tile is stored. */
constexpr int kStageWords = 2 * kUnroll * 32; /* 16-byte words of one tile's staging, per warp */
/* A row whose work is one contiguous range on each side (count 1, or both strides equal to the
 * length): work element k of it sits at k + sdel in src and k + ddel in dst, up to lim. The
 * short-run kernel keeps this form next to each staged row, so a group's addresses are two
 * additions instead of the division and products of locate(). */
struct Affine {
  int64_t sdel, ddel, lim; /* lim < 0: not affine (locate from the full row) */
};
struct WarpSmem {
  uint4 *stage;   /* kStageWords */
  rs_run *rows;   /* 32 */
  int64_t *start; /* 32 */
  Affine *aff;    /* 32, short-run kernel only */
};
__host__ __device__ constexpr int warp_smem_bytes(bool short_runs, int bufs) {
  return bufs * (kStageWords * 16 + 32 * (int)sizeof(rs_run) + 32 * 8 +
                 (short_runs ? 32 * (int)sizeof(Affine) : 0));
}
/* Two tiles in flight per warp hide a tile's descriptor and load latency behind the other's
 * stores. The fp32 -> 16-bit casts hold two 16-byte loads per group and spill with a second
 * tile's state, so they keep one. */
__host__ __device__ constexpr bool two_tiles(int src_size, int dst_size) {
  return !(src_size == 4 && dst_size == 2);
}
__host__ __device__ constexpr int smem_bufs(int src_size, int dst_size) {
  return two_tiles(src_size, dst_size) ? 2 : 1;
}
template <bool SHORT>
__device__ __forceinline__ WarpSmem warp_smem(unsigned char *base, int bufs, int buf) {
  unsigned char *w =
      base + (threadIdx.x >> 5) * warp_smem_bytes(SHORT, bufs) + buf * warp_smem_bytes(SHORT, 1);
  WarpSmem m;
  m.stage = reinterpret_cast<uint4 *>(w);
  m.rows = reinterpret_cast<rs_run *>(w + kStageWords * 16);
  m.start = reinterpret_cast<int64_t *>(w + kStageWords * 16 + 32 * sizeof(rs_run));
  m.aff = reinterpret_cast<Affine *>(w + kStageWords * 16 + 32 * sizeof(rs_run) + 32 * 8);
  return m;
}
extern __shared__ __align__(16) unsigned char rs_dyn_smem[];

/* What the store half of a short tile needs. */
struct ShortTile {
  int64_t t0, t1, rlo, rhi;
  uint64_t vec;    /* per group u, 6 bits at 6u: its row past rlo (bit 5: vectorized) */
  unsigned scalar; /* groups copied element by element */
};

/* Source and destination index of work element k in row c of a short tile, and the elements
 * from k on that are contiguous on both sides. */
template <bool SHORT>
__device__ __forceinline__ void tile_locate(const Params &p, const WarpSmem &m, int c, int64_t k,
                                            int64_t &si, int64_t &di, int64_t &left) {
  if (SHORT) {
    const Affine a = m.aff[c];
    if (a.lim >= 0) {
      si = k + a.sdel;
      di = k + a.ddel;
      left = a.lim - k;
      return;
    }
  }
  locate(p, m.rows[c], m.start[c], k, si, di, left);
}

template <int SK, int DK, bool SHORT>
__device__ __forceinline__ ShortTile short_issue(const Params &p, int64_t rlo, int64_t rhi,
                                                 int64_t pre, int64_t t0, int64_t t1,
                                                 const rs_run &my_row, const WarpSmem &m) {
  typedef typename Store<SK>::T S;
  typedef typename Store<DK>::T D;
  constexpr int V = group_elems(sizeof(S), sizeof(D));
  constexpr int kSrcVec = V * sizeof(S) / 16;
  constexpr int U = groups_per_lane(sizeof(S), sizeof(D));
  const S *__restrict__ src = reinterpret_cast<const S *>(p.src);
  D *__restrict__ dst = reinterpret_cast<D *>(p.dst);
  const int lane = threadIdx.x & 31;
  const int nrows = (int)(rhi - rlo) + 1; /* <= 32 */
  /* prefix[rlo + lane]: lane 0 reads it, the others take their left neighbour's entry */
  int64_t start = __shfl_up_sync(0xFFFFFFFFu, pre, 1);
  if (lane == 0) start = __ldg(p.prefix + rlo);
  /* row ends relative to the tile (they all lie past t0); INT_MAX from t1 on */
  const int pre_rel = pre >= t1 ? 0x7FFFFFFF : (int)(pre - t0);
  __syncwarp(); /* every lane is done with this buffer's previous tile */
  if (lane < nrows) {
    /* one row (a tile inside one strided row): the prefix entries were not loaded */
    const rs_run row = nrows == 1 ? load_row(p.runs, rlo) : my_row;
    m.rows[lane] = row;
    m.start[lane] = start;
    if (SHORT) {
      Affine a;
      const bool affine =
          row.count == 1 || (row.src_stride == row.length && row.dst_stride == row.length);
      a.sdel = p.mode == RS_MODE_UNPACK ? -p.begin : row.src_offset - start;
      a.ddel = p.mode == RS_MODE_PACK ? -p.begin : row.dst_offset - start;
      a.lim = affine ? start + row.length * row.count : -1;
      m.aff[lane] = a;
    }
  }
  __syncwarp();

  ShortTile st;
  st.t0 = t0;
  st.t1 = t1;
  st.rlo = rlo;
  st.rhi = rhi;
  st.vec = 0;
  st.scalar = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int k_rel = (u * 32 + lane) * V;
    const int64_t k = t0 + k_rel;
    int c = 0; /* rows of the tile starting at or before k, past rlo */
#pragma unroll
    for (int step = 16; step >= 1; step >>= 1) {
      const int v = __shfl_sync(0xFFFFFFFFu, pre_rel, c + step - 1);
      if (v <= k_rel) c += step;
    }
    if (k >= t1) continue;
    int64_t si, di, left;
    tile_locate<SHORT>(p, m, c, k, si, di, left);
    const S *sp = src + si;
    if (k + V <= t1 && left >= V && (((uintptr_t)sp | (uintptr_t)(dst + di)) & 15) == 0) {
#pragma unroll
      for (int w = 0; w < kSrcVec; ++w) {
        const unsigned to =
            (unsigned)__cvta_generic_to_shared(m.stage + (u * kSrcVec + w) * 32 + lane);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to),
                     "l"(reinterpret_cast<const uint4 *>(sp) + w));
      }
      st.vec |= (uint64_t)(c | 32) << (6 * u);
    } else {
      st.scalar |= 1u << u;
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  return st;
}

/* The store half: cast and store what short_issue staged (each lane reads back only what it
 * staged itself; its cp.async group must be complete), then the element-wise groups. */
template <int SK, int DK, bool SHORT>
__device__ __forceinline__ void short_finish(const Params &p, const ShortTile &st,
                                             const WarpSmem &m) {
  typedef typename Store<SK>::T S;
  typedef typename Store<DK>::T D;
  constexpr int V = group_elems(sizeof(S), sizeof(D));
  constexpr int kSrcVec = V * sizeof(S) / 16;
  constexpr int kDstVec = V * sizeof(D) / 16;
  constexpr int U = groups_per_lane(sizeof(S), sizeof(D));
  D *__restrict__ dst = reinterpret_cast<D *>(p.dst);
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const unsigned cv = (unsigned)(st.vec >> (6 * u)) & 63u;
    if (!(cv & 32u)) continue;
    const int c = (int)(cv & 31u);
    const int64_t k = st.t0 + (u * 32 + lane) * V;
    int64_t si, di, left;
    tile_locate<SHORT>(p, m, c, k, si, di, left);
    uint4 in[kSrcVec], out[kDstVec];
#pragma unroll
    for (int w = 0; w < kSrcVec; ++w) in[w] = m.stage[(u * kSrcVec + w) * 32 + lane];
    const S *sv = reinterpret_cast<const S *>(in);
    D *dv = reinterpret_cast<D *>(out);
#pragma unroll
    for (int e = 0; e < V; ++e) dv[e] = Cast<SK, DK>::run(sv[e]);
#pragma unroll
    for (int w = 0; w < kDstVec; ++w) reinterpret_cast<uint4 *>(dst + di)[w] = out[w];
  }
  unsigned scalar = st.scalar;
  while (scalar) {
    const int u = __ffs(scalar) - 1;
    scalar &= scalar - 1;
    const int64_t k = st.t0 + (u * 32 + lane) * V;
    copy_scalar<SK, DK>(p, find_row(p.prefix, st.rlo, st.rhi + 1, k), k, min(k + V, st.t1));
  }
}

/* Each warp owns a contiguous range of tiles, so the row of its next tile is found by
 * stepping forward from the last one instead of a search over the whole table. Per tile:
 *  - one run covers the tile (long runs): addresses are affine in the lane, no per-group
 *    lookup, 16-byte accesses when both sides are aligned;
 *  - the tile spans at most 32 rows (short runs): short_issue / short_finish, each lane
 *    holding one prefix entry and finding its groups' rows by a binary search over
 *    registers (shuffles);
 *  - more rows (runs of a few elements): a per-lane binary search between the tile's rows. */
template <int SK, int DK, bool SHORT>
__global__ void __launch_bounds__(kThreads, 2) copy_kernel(Params p) {
  typedef typename Store<SK>::T S;
  typedef typename Store<DK>::T D;
  constexpr int V = group_elems(sizeof(S), sizeof(D));
  constexpr int kSrcVec = V * sizeof(S) / 16; /* 16-byte words per group, each side */
  constexpr int kDstVec = V * sizeof(D) / 16;
  constexpr int U = groups_per_lane(sizeof(S), sizeof(D));
  constexpr int64_t kSpan = tile_elems(sizeof(S), sizeof(D));
  static_assert(kSpan == 32 * U * V, "a tile is 32 lanes x U groups x V elements");

  constexpr bool kTwoTiles = two_tiles(sizeof(S), sizeof(D));
  constexpr int kBufs = smem_bufs(sizeof(S), sizeof(D));
  int buf = 0;          /* kTwoTiles: the buffer the next short tile uses */
  bool pending = false; /* kTwoTiles: a short tile issued but not stored yet */
  ShortTile pend;
  const S *__restrict__ src = reinterpret_cast<const S *>(p.src);
  D *__restrict__ dst = reinterpret_cast<D *>(p.dst);
  const int lane = threadIdx.x & 31;
  const int64_t warp = ((int64_t)blockIdx.x * kThreads + threadIdx.x) >> 5;
  const int64_t nwarps = ((int64_t)gridDim.x * kThreads) >> 5;
  const int64_t tiles = (p.end - p.begin + kSpan - 1) / kSpan;
  const int64_t per_warp = (tiles + nwarps - 1) / nwarps;
  const int64_t tile_begin = warp * per_warp;
  const int64_t tile_end = min(tiles, tile_begin + per_warp);

  int64_t rlo = -1;
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t t0 = p.begin + tile * kSpan;
    const int64_t t1 = min(t0 + kSpan, p.end);
    /* warp-uniform row range [rlo, rhi] of the tile */
    if (rlo < 0) {
      rlo = find_row(p.prefix, 0, p.n, t0);
    } else {
      while (__ldg(p.prefix + rlo + 1) <= t0) ++rlo; /* next tile: a step or two forward */
    }
    int64_t rhi = rlo;
    /* lane i holds prefix[rlo + 1 + i] (INT64_MAX past the table) */
    int64_t pre = INT64_MAX;
    rs_run my_row;
    const int64_t rlo_end = __ldg(p.prefix + rlo + 1);
    if (rlo_end < t1) {
      pre = rlo + 1 + lane <= p.n ? __ldg(p.prefix + rlo + 1 + lane) : INT64_MAX;
      if (rlo + lane < p.n) my_row = load_row(p.runs, rlo + lane);
      const unsigned below = __ballot_sync(0xFFFFFFFFu, pre <= t1 - 1);
      rhi = below == 0xFFFFFFFFu ? find_row(p.prefix, rlo, p.n, t1 - 1) : rlo + __popc(below);
    }

    if (rhi == rlo) {
      const rs_run row = load_row(p.runs, rlo);
      const int64_t rs = __ldg(p.prefix + rlo);
      int64_t si0, di0, left0;
      locate(p, row, rs, t0, si0, di0, left0);
      if (left0 >= t1 - t0) { /* one run covers the tile: affine addresses */
        const bool aligned = ((((uintptr_t)(src + si0)) | ((uintptr_t)(dst + di0))) & 15) == 0;
        if (aligned) {
          /* constant offsets from one base per side: no address registers per group */
          const uint4 *sb = reinterpret_cast<const uint4 *>(src + si0) + lane * kSrcVec;
          uint4 *db = reinterpret_cast<uint4 *>(dst + di0) + lane * kDstVec;
          if (t1 - t0 == kSpan) {
            uint4 val[U][kSrcVec];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
              for (int w = 0; w < kSrcVec; ++w) val[u][w] = sb[u * 32 * kSrcVec + w];
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const S *sv = reinterpret_cast<const S *>(val[u]);
              uint4 out[kDstVec];
              D *dv = reinterpret_cast<D *>(out);
#pragma unroll
              for (int e = 0; e < V; ++e) dv[e] = Cast<SK, DK>::run(sv[e]);
#pragma unroll
              for (int w = 0; w < kDstVec; ++w) db[u * 32 * kDstVec + w] = out[w];
            }
          } else { /* the last, partial tile */
            for (int u = 0; u < U; ++u) {
              const int64_t off = ((int64_t)u * 32 + lane) * V;
              if (t0 + off + V <= t1) {
                uint4 in[kSrcVec], out[kDstVec];
#pragma unroll
                for (int w = 0; w < kSrcVec; ++w) in[w] = sb[u * 32 * kSrcVec + w];
                const S *sv = reinterpret_cast<const S *>(in);
                D *dv = reinterpret_cast<D *>(out);
#pragma unroll
                for (int e = 0; e < V; ++e) dv[e] = Cast<SK, DK>::run(sv[e]);
#pragma unroll
                for (int w = 0; w < kDstVec; ++w) db[u * 32 * kDstVec + w] = out[w];
              } else if (t0 + off < t1) {
                for (int64_t e = off; e < t1 - t0; ++e)
                  dst[di0 + e] = Cast<SK, DK>::run(src[si0 + e]);
              }
            }
          }
        } else { /* misaligned run: coalesced elements, U * V per lane */
          for (int64_t e = lane; e < t1 - t0; e += 32)
            dst[di0 + e] = Cast<SK, DK>::run(src[si0 + e]);
        }
        continue;
      }
    }

    if (rhi - rlo < 32) {
      const WarpSmem m = warp_smem<SHORT>(rs_dyn_smem, kBufs, buf);
      const ShortTile st = short_issue<SK, DK, SHORT>(p, rlo, rhi, pre, t0, t1, my_row, m);
      if (kTwoTiles) {
        if (pending) {
          asm volatile("cp.async.wait_group 1;" ::: "memory");
          short_finish<SK, DK, SHORT>(p, pend, warp_smem<SHORT>(rs_dyn_smem, kBufs, buf ^ 1));
        }
        pend = st;
        pending = true;
        buf ^= 1;
      } else {
        asm volatile("cp.async.wait_all;" ::: "memory");
        short_finish<SK, DK, SHORT>(p, st, m);
      }
      rlo = rhi;
      continue;
    }

    /* more than 32 rows in the tile (runs of a few elements): a per-lane binary search
     * between the tile's rows, four groups at a time (registers) */
#pragma unroll 1
    for (int h = 0; h < U; h += 4) {
      uint4 val[4][kSrcVec];
      int64_t dvec[4];
#pragma unroll
      for (int uu = 0; uu < 4; ++uu) {
        dvec[uu] = -1;
        const int64_t k = t0 + ((int64_t)(h + uu) * 32 + lane) * V;
        if (k >= t1) continue;
        const int64_t r = find_row(p.prefix, rlo, rhi + 1, k);
        const rs_run row = load_row(p.runs, r);
        const int64_t row_start = __ldg(p.prefix + r);
        int64_t si, di, left;
        locate(p, row, row_start, k, si, di, left);
        const S *sp = src + si;
        D *dp = dst + di;
        if (k + V <= t1 && left >= V && (((uintptr_t)sp | (uintptr_t)dp) & 15) == 0) {
#pragma unroll
          for (int w = 0; w < kSrcVec; ++w) val[uu][w] = reinterpret_cast<const uint4 *>(sp)[w];
          dvec[uu] = di;
          continue;
        }
        copy_scalar<SK, DK>(p, r, k, min(k + V, t1));
      }
#pragma unroll
      for (int uu = 0; uu < 4; ++uu) {
        if (dvec[uu] < 0) continue;
        const S *sv = reinterpret_cast<const S *>(val[uu]);
        uint4 out[kDstVec];
        D *dv = reinterpret_cast<D *>(out);
#pragma unroll
        for (int e = 0; e < V; ++e) dv[e] = Cast<SK, DK>::run(sv[e]);
        uint4 *dp = reinterpret_cast<uint4 *>(dst + dvec[uu]);
#pragma unroll
        for (int w = 0; w < kDstVec; ++w) dp[w] = out[w];
      }
    }
    rlo = rhi; /* the next tile starts in rhi or later */
  }
  if (kTwoTiles && pending) { /* the other paths use no shared memory: it could wait */
    asm volatile("cp.async.wait_all;" ::: "memory");
    short_finish<SK, DK, SHORT>(p, pend, warp_smem<SHORT>(rs_dyn_smem, kBufs, buf ^ 1));
  }
}

int kind_of(rs_dtype d) {
  switch (d) {
    case RS_F32: return K_F32;
    case RS_BF16: return K_BF16;
    case RS_F16: return K_F16;
    case RS_RAW1: return K_RAW1;
    case RS_RAW2: return K_RAW2;
    case RS_RAW4: return K_RAW4;
    case RS_RAW8: return K_RAW8;
    default: return -1;
  }
}

/* Same-dtype copies move raw bits of the element size. */
int raw_kind(rs_dtype d) {
  switch (d) {
    case RS_F32:
    case RS_RAW4: return K_RAW4;
    case RS_BF16:
    case RS_F16:
    case RS_RAW2: return K_RAW2;
    case RS_RAW1: return K_RAW1;
    case RS_RAW8: return K_RAW8;
    default: return -1;
  }
}

typedef void (*kernel_fn)(Params);

template <bool SHORT>
kernel_fn pick_kernel(rs_dtype s, rs_dtype d) {
  if (s == d) {
    switch (raw_kind(s)) {
      case K_RAW1: return copy_kernel<K_RAW1, K_RAW1, SHORT>;
      case K_RAW2: return copy_kernel<K_RAW2, K_RAW2, SHORT>;
      case K_RAW4: return copy_kernel<K_RAW4, K_RAW4, SHORT>;
      case K_RAW8: return copy_kernel<K_RAW8, K_RAW8, SHORT>;
      default: return nullptr;
    }
  }
  const int a = kind_of(s), b = kind_of(d);
  if (a == K_F32 && b == K_BF16) return copy_kernel<K_F32, K_BF16, SHORT>;
  if (a == K_F32 && b == K_F16) return copy_kernel<K_F32, K_F16, SHORT>;
  if (a == K_BF16 && b == K_F32) return copy_kernel<K_BF16, K_F32, SHORT>;
  if (a == K_F16 && b == K_F32) return copy_kernel<K_F16, K_F32, SHORT>;
  if (a == K_BF16 && b == K_F16) return copy_kernel<K_BF16, K_F16, SHORT>;
  if (a == K_F16 && b == K_BF16) return copy_kernel<K_F16, K_BF16, SHORT>;
  return nullptr;
}

/* Multiprocessor count per device, read once (a benign race: every writer stores the same). */
int sm_count(int device) {
  static int cache[64];
  if (device < 0 || device >= 64) return 132;
  if (cache[device] == 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || v <= 0)
      v = 132;
    cache[device] = v;
  }
  return cache[device];
}

/* Blocks of kThreads that fit on one multiprocessor, per kernel and device (read once; benign
 * race). Shared memory beyond the default 48 KiB is opted into here, once per kernel and
 * device (a function attribute is per device). */
int resident_blocks(const void *fn, int device, size_t smem) {
  static const void *fns[64];
  static int devices[64], counts[64];
  for (int i = 0; i < 64; ++i) {
    if (fns[i] == fn && devices[i] == device) return counts[i];
  }
  int c = 0;
  if (smem > 48 * 1024 && cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)smem) != cudaSuccess)
    return -1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c, fn, kThreads, smem) != cudaSuccess ||
      c < 1) {
    cudaGetLastError();
    c = 2;
  }
  for (int i = 0; i < 64; ++i) {
    if (fns[i] == nullptr) {
      devices[i] = device;
      counts[i] = c;
      fns[i] = fn;
      break;
    }
  }
  return c;
}

/* ---- the compact form (rs_compact_*): one descriptor load per slot group ----------------- */

constexpr int kCompactInFlight = 4; /* groups per thread in flight */
constexpr int64_t kDstIndexMask = ((int64_t)1 << 48) - 1;

struct CompactParams {
  const char *src;
  char *dst;
  const void *pieces;
  int64_t groups; /* pieces << lg */
  int lg;         /* log2 of a piece's groups */
  int lp;         /* log2 of a piece's slots, in elements */
};

/* Source index, destination index and length of a piece. */
template <int FORM>
__device__ __forceinline__ void compact_piece(const void *pieces, int64_t piece, int lp, int64_t &s,
                                              int64_t &d, int64_t &len) {
  if (FORM == RS_COMPACT_U32) {
    const uint2 q = __ldg(reinterpret_cast<const uint2 *>(pieces) + piece);
    s = q.x;
    d = q.y;
    len = (int64_t)1 << lp;
  } else {
    const longlong2 q = __ldg(reinterpret_cast<const longlong2 *>(pieces) + piece);
    s = q.x;
    d = q.y & kDstIndexMask;
    len = (int64_t)((unsigned long long)q.y >> 48) + 1;
  }
}

/* Group g (V elements) of the slot space belongs to piece g >> lg; every thread takes groups
 * g, g + stride, ... (kCompactInFlight of them loaded before the first store), so each of a
 * warp's accesses is contiguous within its pieces. */
template <int SK, int DK, int FORM>
__global__ void __launch_bounds__(kThreads) compact_kernel(CompactParams p) {
  typedef typename Store<SK>::T S;
  typedef typename Store<DK>::T D;
  constexpr int V = group_elems(sizeof(S), sizeof(D));
  constexpr int kSrcVec = V * sizeof(S) / 16;
  constexpr int kDstVec = V * sizeof(D) / 16;
  const S *__restrict__ src = reinterpret_cast<const S *>(p.src);
  D *__restrict__ dst = reinterpret_cast<D *>(p.dst);
  const int64_t stride = (int64_t)gridDim.x * kThreads;
  const int64_t mask = ((int64_t)1 << p.lg) - 1;
  for (int64_t g = (int64_t)blockIdx.x * kThreads + threadIdx.x; g < p.groups;
       g += kCompactInFlight * stride) {
    uint4 val[kCompactInFlight][kSrcVec];
    int64_t dpos[kCompactInFlight];
#pragma unroll
    for (int u = 0; u < kCompactInFlight; ++u) {
      const int64_t gu = g + u * stride;
      dpos[u] = -1;
      if (gu >= p.groups) continue;
      int64_t s, d, len;
      compact_piece<FORM>(p.pieces, gu >> p.lg, p.lp, s, d, len);
      const int64_t e0 = (gu & mask) * V;
      if (e0 >= len) continue; /* an idle slot past the piece's end */
      const S *sp = src + s + e0;
      D *dp = dst + d + e0;
      if (e0 + V <= len && (((uintptr_t)sp | (uintptr_t)dp) & 15) == 0) {
#pragma unroll
        for (int w = 0; w < kSrcVec; ++w)
          val[u][w] = __ldg(reinterpret_cast<const uint4 *>(sp) + w);
        dpos[u] = d + e0;
      } else {
        const int64_t m = len - e0 < V ? len - e0 : V;
        for (int64_t e = 0; e < m; ++e) dp[e] = Cast<SK, DK>::run(sp[e]);
      }
    }
#pragma unroll
    for (int u = 0; u < kCompactInFlight; ++u) {
      if (dpos[u] < 0) continue;
      const S *sv = reinterpret_cast<const S *>(val[u]);
      uint4 out[kDstVec];
      D *dv = reinterpret_cast<D *>(out);
#pragma unroll
      for (int e = 0; e < V; ++e) dv[e] = Cast<SK, DK>::run(sv[e]);
      uint4 *dq = reinterpret_cast<uint4 *>(dst + dpos[u]);
#pragma unroll
      for (int w = 0; w < kDstVec; ++w) dq[w] = out[w];
    }
  }
}

typedef void (*compact_fn)(CompactParams);

template <int FORM>
compact_fn pick_compact(rs_dtype s, rs_dtype d) {
  if (s == d) {
    switch (raw_kind(s)) {
      case K_RAW1: return compact_kernel<K_RAW1, K_RAW1, FORM>;
      case K_RAW2: return compact_kernel<K_RAW2, K_RAW2, FORM>;
      case K_RAW4: return compact_kernel<K_RAW4, K_RAW4, FORM>;
      case K_RAW8: return compact_kernel<K_RAW8, K_RAW8, FORM>;
      default: return nullptr;
    }
  }
  const int a = kind_of(s), b = kind_of(d);
  if (a == K_F32 && b == K_BF16) return compact_kernel<K_F32, K_BF16, FORM>;
  if (a == K_F32 && b == K_F16) return compact_kernel<K_F32, K_F16, FORM>;
  if (a == K_BF16 && b == K_F32) return compact_kernel<K_BF16, K_F32, FORM>;
  if (a == K_F16 && b == K_F32) return compact_kernel<K_F16, K_F32, FORM>;
  if (a == K_BF16 && b == K_F16) return compact_kernel<K_BF16, K_F16, FORM>;
  if (a == K_F16 && b == K_BF16) return compact_kernel<K_F16, K_BF16, FORM>;
  return nullptr;
}

int log2_exact(int64_t x) { /* x a power of two */
  int l = 0;
  while (((int64_t)1 << l) < x) ++l;
  return l;
}

}  // namespace

extern "C" rs_status rs_cuda_copy_slice(const void *src, rs_dtype src_dtype, void *dst,
                                        rs_dtype dst_dtype, const rs_run *d_runs, int64_t n,
                                        const int64_t *d_prefix, int64_t begin, int64_t end,
                                        rs_mode mode, void *stream, rs_error *err) {
  if (mode != RS_MODE_RUNS && mode != RS_MODE_PACK && mode != RS_MODE_UNPACK)
    return rs_fail(err, RS_EINVAL, -1, -1, "copy_runs (CUDA): bad mode");
  if (begin < 0 || end < begin)
    return rs_fail(err, RS_EINVAL, -1, -1, "copy_runs (CUDA): bad work range");
  const int ss = (int)rs_dtype_size(src_dtype), ds = (int)rs_dtype_size(dst_dtype);
  /* The short-run kernel when the range averages at most kShortRowBytes of source per row of
   * the table (n counts every row, so a slice of a table errs towards it; it is correct for
   * any table, only slower on long or strided runs). */
  const bool short_runs = (end - begin) * ss <= kShortRowBytes * n;
  kernel_fn fn = short_runs ? pick_kernel<true>(src_dtype, dst_dtype)
                            : pick_kernel<false>(src_dtype, dst_dtype);
  if (!fn)
    return rs_fail(err, RS_EDTYPE, -1, -1, "copy_runs (CUDA): unsupported dtype pair %s -> %s",
                   rs_dtype_name(src_dtype), rs_dtype_name(dst_dtype));
  if (end == begin || n == 0) return RS_OK;
  if (!src || !dst || !d_runs || !d_prefix)
    return rs_fail(err, RS_EINVAL, -1, -1, "copy_runs (CUDA): null pointer");

  int device = 0;
  RS_CUDA_TRY("copy_runs (CUDA): cudaGetDevice", cudaGetDevice(&device), err);
  const int64_t span = tile_elems(ss, ds); /* = kernel's */
  /* warp-private shared memory of the short-run tiles (the kernel's own layout) */
  const size_t smem = (size_t)(kThreads / 32) * warp_smem_bytes(short_runs, smem_bufs(ss, ds));
  const int64_t tiles = (end - begin + span - 1) / span;
  const int64_t warps_per_block = kThreads / 32;
  int64_t blocks = (tiles + warps_per_block - 1) / warps_per_block;
  /* One resident wave: each warp then walks a contiguous range of tiles. */
  const int resident = resident_blocks(reinterpret_cast<const void *>(fn), device, smem);
  if (resident < 0) {
    const cudaError_t e = cudaGetLastError();
    return rs_cuda_fail(err, "copy_runs (CUDA): cudaFuncSetAttribute (shared memory)", e);
  }
  const int64_t cap = (int64_t)sm_count(device) * resident;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;

  Params p;
  p.src = static_cast<const char *>(src);
  p.dst = static_cast<char *>(dst);
  p.runs = d_runs;
  p.prefix = d_prefix;
  p.n = n;
  p.begin = begin;
  p.end = end;
  p.mode = (int)mode;
  cudaGetLastError(); /* a stale error from elsewhere must not be reported as ours */
  fn<<<(unsigned)blocks, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  RS_CUDA_TRY("copy_runs (CUDA): kernel launch", cudaGetLastError(), err);
  return RS_OK;
}

extern "C" void rs_compact_choose(const rs_run *runs, int64_t n, int64_t total, int64_t src_numel,
                                  int64_t dst_numel, int src_size, int dst_size,
                                  int64_t max_run_bytes, rs_compact_plan *plan) {
  plan->form = RS_COMPACT_NONE;
  plan->lp = 0;
  plan->pieces = 0;
  plan->bytes = 0;
  if (total <= 0 || n <= 0 || src_size <= 0 || dst_size <= 0) return;
  const int lv = log2_exact(group_elems(src_size, dst_size)); /* a piece holds whole groups */
  constexpr int kMaxLp = 16;                                  /* I64 keeps length - 1 in 16 bits */
  int64_t n_runs = 0;
  uint64_t lengths = 0; /* OR of the run lengths: its lowest set bit divides all of them */
  int64_t pieces[kMaxLp + 1] = {0};
  for (int64_t i = 0; i < n; ++i) {
    const rs_run &r = runs[i];
    if (r.length <= 0 || r.count <= 0) continue;
    n_runs += r.count;
    lengths |= (uint64_t)r.length;
    for (int lp = lv; lp <= kMaxLp; ++lp) /* <= total: no overflow */
      pieces[lp] += r.count * ((r.length + ((int64_t)1 << lp) - 1) >> lp);
  }
  if (n_runs == 0 || (double)total * src_size > (double)max_run_bytes * (double)n_runs) return;
  const double bound = fmax(56.0 * (double)n + 8.0, (double)total * src_size / 16.0);
  const double four_g = 4294967296.0;
  double best = -1;
  int lp_u32 = 0;
  while (lp_u32 < kMaxLp && !((lengths >> lp_u32) & 1)) ++lp_u32;
  if (lp_u32 >= lv && (double)src_numel <= four_g && (double)dst_numel <= four_g &&
      8.0 * (double)pieces[lp_u32] <= bound) {
    best = 8.0 * (double)pieces[lp_u32];
    plan->form = RS_COMPACT_U32;
    plan->lp = lp_u32;
  }
  if (dst_numel <= kDstIndexMask + 1) {
    for (int lp = lv; lp <= kMaxLp; ++lp) {
      const double bytes = 16.0 * (double)pieces[lp];
      if ((double)pieces[lp] * (double)((int64_t)1 << lp) > 4.0e18) continue; /* slots: int64 */
      const double idle = (double)pieces[lp] * (double)((int64_t)1 << lp) - (double)total;
      const double cost = bytes + idle * (src_size + dst_size) / 8.0;
      if (bytes <= bound && (best < 0 || cost < best)) {
        best = cost;
        plan->form = RS_COMPACT_I64;
        plan->lp = lp;
      }
    }
  }
  if (plan->form == RS_COMPACT_NONE) return;
  plan->pieces = pieces[plan->lp];
  plan->bytes = plan->pieces * (plan->form == RS_COMPACT_U32 ? 8 : 16);
}

extern "C" void rs_compact_fill(const rs_run *runs, int64_t n, const rs_compact_plan *plan,
                                void *out) {
  const int64_t piece_len = (int64_t)1 << plan->lp;
  uint32_t *u = static_cast<uint32_t *>(out);
  int64_t *w = static_cast<int64_t *>(out);
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    const rs_run &r = runs[i];
    if (r.length <= 0 || r.count <= 0) continue;
    for (int64_t c = 0; c < r.count; ++c) {
      const int64_t s = r.src_offset + c * r.src_stride, d = r.dst_offset + c * r.dst_stride;
      for (int64_t j = 0; j < r.length; j += piece_len, ++k) {
        if (plan->form == RS_COMPACT_U32) {
          u[2 * k] = (uint32_t)(s + j);
          u[2 * k + 1] = (uint32_t)(d + j);
        } else {
          const int64_t len = r.length - j < piece_len ? r.length - j : piece_len;
          w[2 * k] = s + j;
          w[2 * k + 1] = (int64_t)((uint64_t)(d + j) | ((uint64_t)(len - 1) << 48));
        }
      }
    }
  }
}

extern "C" rs_status rs_cuda_copy_compact(const void *src, rs_dtype src_dtype, void *dst,
                                          rs_dtype dst_dtype, const rs_compact_plan *plan,
                                          const void *d_pieces, void *stream, rs_error *err) {
  if (!plan || (plan->form != RS_COMPACT_U32 && plan->form != RS_COMPACT_I64))
    return rs_fail(err, RS_EINVAL, -1, -1, "copy_runs (CUDA): no compact form");
  compact_fn fn = plan->form == RS_COMPACT_U32 ? pick_compact<RS_COMPACT_U32>(src_dtype, dst_dtype)
                                               : pick_compact<RS_COMPACT_I64>(src_dtype, dst_dtype);
  if (!fn)
    return rs_fail(err, RS_EDTYPE, -1, -1, "copy_runs (CUDA): unsupported dtype pair %s -> %s",
                   rs_dtype_name(src_dtype), rs_dtype_name(dst_dtype));
  if (plan->pieces == 0) return RS_OK;
  if (!src || !dst || !d_pieces)
    return rs_fail(err, RS_EINVAL, -1, -1, "copy_runs (CUDA): null pointer");
  const int lv =
      log2_exact(group_elems((int)rs_dtype_size(src_dtype), (int)rs_dtype_size(dst_dtype)));
  if (plan->lp < lv)
    return rs_fail(err, RS_EINVAL, -1, -1,
                   "copy_runs (CUDA): compact pieces shorter than a group of this dtype pair");
  int device = 0;
  RS_CUDA_TRY("copy_runs (CUDA): cudaGetDevice", cudaGetDevice(&device), err);
  CompactParams p;
  p.src = static_cast<const char *>(src);
  p.dst = static_cast<char *>(dst);
  p.pieces = d_pieces;
  p.lp = plan->lp;
  p.lg = plan->lp - lv;
  p.groups = plan->pieces << p.lg;
  const int resident = resident_blocks(reinterpret_cast<const void *>(fn), device, 0);
  if (resident < 0) {
    const cudaError_t e = cudaGetLastError();
    return rs_cuda_fail(err, "copy_runs (CUDA): cudaFuncSetAttribute", e);
  }
  int64_t blocks = (p.groups + kThreads - 1) / kThreads;
  const int64_t cap = (int64_t)sm_count(device) * resident; /* one resident wave */
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  cudaGetLastError(); /* a stale error from elsewhere must not be reported as ours */
  fn<<<(unsigned)blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  RS_CUDA_TRY("copy_runs (CUDA): kernel launch", cudaGetLastError(), err);
  return RS_OK;
}
