/* reshard CUDA half: the device copy of a descriptor table, and the event-ordered staging
 * loop between CPU and GPU buffers. A C API with no torch types; compiled by nvcc.
 *
 * Same conventions as the C core (../reshard.h): every function returns an rs_status and
 * fills a caller-provided rs_error; nothing prints, exits or aborts. CUDA failures come back
 * as RS_EDEVICE with the CUDA error string in err->msg. Tables are validated by the C core
 * (rs_validate) before they reach these functions; nothing here re-checks ranges.
 *
 * Streams are passed as `void *` (a cudaStream_t) so this header needs no CUDA header.
 */
#ifndef RESHARD_CUDA_H
#define RESHARD_CUDA_H

#include <stdint.h>

#include "../reshard.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Copies work elements [begin, end) of a validated table on `stream` in ONE kernel launch,
 * with the cast src_dtype -> dst_dtype (same pairs and same bits as rs_copy_slice).
 * d_runs (n rows) and d_prefix (n + 1 entries, from rs_prefix) live in device memory.
 * src and dst are device pointers (or host pointers the device can address: pinned or
 * registered memory under unified addressing). Modes as in rs_copy_slice: in RS_MODE_PACK
 * dst[k - begin] holds work element k; in RS_MODE_UNPACK src[k - begin] does.
 * 16-byte loads and stores wherever a group of elements lies in one run and both addresses
 * are 16-byte aligned; element by element elsewhere. Returns after the launch (asynchronous). */
rs_status rs_cuda_copy_slice(const void *src, rs_dtype src_dtype, void *dst, rs_dtype dst_dtype,
                             const rs_run *d_runs, int64_t n, const int64_t *d_prefix,
                             int64_t begin, int64_t end, rs_mode mode, void *stream, rs_error *err);

/* ---- compact form of a cached short-run table ---------------------------------------- */

/* A validated table cut into pieces of at most 2^lp elements, each contiguous on both sides,
 * in table order. Slot x of [0, pieces << lp) is element x mod 2^lp of piece x >> lp, so a
 * thread finds its piece with a shift and one descriptor load: 8 or 16 bytes per piece
 * instead of the 48-byte row and 8-byte prefix entry per run of rs_cuda_copy_slice. */
typedef enum rs_compact_form {
  RS_COMPACT_NONE = 0, /* no compact form: rs_cuda_copy_slice */
  RS_COMPACT_U32 = 1,  /* uint32 {src, dst} element index per piece; every piece 2^lp long */
  RS_COMPACT_I64 = 2   /* int64 {src, dst | (length - 1) << 48} per piece; lp <= 16 */
} rs_compact_form;

typedef struct rs_compact_plan {
  rs_compact_form form;
  int lp;         /* log2 of a piece's slots, in elements */
  int64_t pieces; /* descriptors */
  int64_t bytes;  /* their size: pieces * 8 (U32) or pieces * 16 (I64) */
} rs_compact_plan;

/* Compact forms are only built for tables averaging at most this many source bytes per run
 * (the longest runs measured; the compact kernel was the faster one up to there). */
#define RS_COMPACT_MAX_RUN_BYTES ((int64_t)65536)

/* Chooses the compact form of a validated table (n rows, total work elements) for element
 * sizes src_size -> dst_size: RS_COMPACT_NONE when the table averages more than max_run_bytes
 * of source per run, or no form fits in max(56 * n + 8, total * src_size / 16) bytes (the
 * table's own device copy, or a sixteenth of the bytes a copy reads). U32 needs every index
 * below 2^32 (src_numel, dst_numel <= 2^32) and every run length a multiple of 2^lp; I64
 * needs dst_numel <= 2^48. Among the fitting forms and piece sizes, the one with the fewest
 * descriptor bytes plus an eighth of the bytes its idle slots (past a piece's end) stand for. */
void rs_compact_choose(const rs_run *runs, int64_t n, int64_t total, int64_t src_numel,
                       int64_t dst_numel, int src_size, int dst_size, int64_t max_run_bytes,
                       rs_compact_plan *plan);

/* Writes plan->bytes of descriptors (plan from rs_compact_choose on the same table) to out. */
void rs_compact_fill(const rs_run *runs, int64_t n, const rs_compact_plan *plan, void *out);

/* Copies the whole table (RS_MODE_RUNS) from its compact form d_pieces (device memory, as
 * rs_compact_fill wrote it) in one launch on `stream`: one 16-byte group per thread and
 * slot, four in flight, element by element where a group is misaligned or past a piece's
 * end. Same results as rs_cuda_copy_slice over [0, total). Asynchronous. */
rs_status rs_cuda_copy_compact(const void *src, rs_dtype src_dtype, void *dst, rs_dtype dst_dtype,
                               const rs_compact_plan *plan, const void *d_pieces, void *stream,
                               rs_error *err);

/* ---- staging between host and device ------------------------------------------------- */

typedef enum rs_direction { RS_H2D = 0, RS_D2H = 1 } rs_direction;

/* The host half of the staging loop: copies work [begin, end) of the ring table between the
 * host buffer and a ring slot (RS_MODE_PACK for H2D, RS_MODE_UNPACK for D2H). The caller
 * supplies it so that packing runs on its thread pool (csrc/ops.cpp: at::parallel_for over
 * rs_copy_slice). Returns RS_OK or an error code. */
typedef rs_status (*rs_host_copy_fn)(void *ctx, const void *src, rs_dtype src_dtype, void *dst,
                                     rs_dtype dst_dtype, const rs_run *runs, int64_t n,
                                     const int64_t *prefix, int64_t begin, int64_t end,
                                     rs_mode mode);

/* A validated table split in two parts:
 *  - ring rows (runs/prefix on the host, d_runs/d_prefix the same on the device): packed
 *    on the host into a pinned ring slot, moved by one DMA per slot, scattered on the device
 *    by rs_cuda_copy_slice (H2D); or gathered on the device, one DMA per slot, scattered on
 *    the host (D2H);
 *  - direct rows: cudaMemcpyAsync / cudaMemcpy2DAsync straight between the pinned host
 *    buffer and the device buffer, no bounce (only when the host buffer is pinned and the
 *    dtypes are equal; see rs_stage_row_is_direct). */
typedef struct rs_stage_table {
  const rs_run *runs;
  const int64_t *prefix;
  int64_t n;
  int64_t total; /* prefix[n] */
  const rs_run *d_runs;
  const int64_t *d_prefix;
  const rs_run *direct;
  int64_t n_direct;
  /* 1 when the device side (H2D: dst, D2H: src) already holds work element k of the ring
   * table at index k and in the wire dtype (a packed arena segment): the slot's DMA then goes
   * straight to/from the device buffer, with no device staging and no scatter/gather kernel. */
  int device_dense;
} rs_stage_table;

typedef struct rs_stage_buffers {
  const void *src; /* H2D: host; D2H: device */
  rs_dtype src_dtype;
  void *dst; /* H2D: device; D2H: host */
  rs_dtype dst_dtype;
  void *ring; /* pinned host memory, 16-byte aligned */
  int64_t ring_bytes;
  void *staging;     /* device memory, 16-byte aligned, >= rs_stage_device_bytes(ring_bytes);
                        NULL allowed when table->device_dense */
  void *stream;      /* cudaStream_t: every copy and kernel is ordered on it */
  int64_t *progress; /* H2D without direct rows: a progress word (reshard.h) published with the
                        table elements [0, n) whose copies are queued on the stream, each time
                        n grows; NULL: none */
} rs_stage_buffers;

typedef struct rs_stage_stats {
  int64_t slots;        /* ring slots used (0 when there are no ring rows) */
  int64_t slot_bytes;   /* bytes of one slot */
  int64_t chunks;       /* slot-sized chunks moved through the ring */
  int64_t ring_bytes;   /* wire bytes moved through the ring */
  int64_t direct_bytes; /* bytes moved by direct copies */
  int64_t direct_copies;
  int64_t host_waits; /* event waits on the host (one per reused slot, plus the final one) */
} rs_stage_stats;

/* Rows of at least this many bytes per run go direct when the host side is pinned. */
#define RS_STAGE_DIRECT_MIN_BYTES ((int64_t)256 * 1024)
/* The ring is cut into this many slots (fewer when it is small: see rs_stage_slots). */
#define RS_STAGE_MAX_SLOTS 4
/* Smallest useful ring: two slots of 16 bytes. */
#define RS_STAGE_MIN_RING_BYTES 32

/* The dtype that crosses PCIe: the narrower of the two; on a tie the cast (if any) runs on
 * the device (H2D: the source dtype travels; D2H: the target dtype travels). */
rs_dtype rs_stage_wire_dtype(rs_direction dir, rs_dtype src_dtype, rs_dtype dst_dtype);

/* 1 if a row goes direct (no bounce) when the host buffer is pinned and dtypes are equal:
 * runs of >= min_bytes each, and for count > 1 both strides >= length (cudaMemcpy2D). */
int rs_stage_row_is_direct(const rs_run *row, int64_t elem_size, int64_t min_bytes);

/* How a ring of ring_bytes is cut: *slots in [2, RS_STAGE_MAX_SLOTS], each *slot_bytes (a
 * multiple of 16; at least 16). RS_EINVAL when ring_bytes < RS_STAGE_MIN_RING_BYTES. */
rs_status rs_stage_slots(int64_t ring_bytes, int64_t *slots, int64_t *slot_bytes, rs_error *err);

/* Device staging the loop needs for a ring of ring_bytes: slots * slot_bytes (<= ring_bytes). */
int64_t rs_stage_device_bytes(int64_t ring_bytes);

/* Runs the staging loop. H2D: for each chunk k (slot s = k mod slots): wait for the event of
 * the DMA that last read slot s, pack chunk k into it on the host (host_copy), DMA it into
 * device staging slot s, record the slot's event, scatter it on the device. The host packs
 * chunk k while chunk k-1 is in flight. D2H: gather chunk k on the device into staging slot
 * s, DMA it into ring slot s, record the event; before reusing slot s, wait for its event
 * once and scatter the chunk it holds on the host. Direct rows are issued interleaved with
 * the ring chunks, in proportion to their bytes, so the link stays busy while the host packs.
 * Returns when every host byte (reads of an H2D source and of the ring, writes of a D2H
 * target) is done; device-side scatters of an H2D may still be queued on the stream. */
rs_status rs_cuda_stage(rs_direction dir, const rs_stage_table *table, const rs_stage_buffers *buf,
                        rs_host_copy_fn host_copy, void *ctx, rs_stage_stats *stats, rs_error *err);

/* ---- H2D as one queue over the host's threads ------------------------------------------ */

/* Runs body(arg, i) for every i in [0, workers), concurrently where it can, and returns once
 * all have returned (csrc/ops.cpp: at::parallel_for). */
typedef void (*rs_worker_fn)(void *arg, int64_t worker);
typedef void (*rs_parallel_fn)(void *ctx, int64_t workers, rs_worker_fn body, void *arg);

/* Queue slots: up to this many bytes each (DMAs of a few MiB run at the link's rate) ... */
#define RS_STAGE_QUEUE_SLOT_BYTES ((int64_t)4 << 20)
/* ... at most this many of them ... */
#define RS_STAGE_QUEUE_MAX_SLOTS 16
/* ... each packed in sub-chunks of this many bytes, one host thread per sub-chunk. */
#define RS_STAGE_QUEUE_SUB_BYTES ((int64_t)256 << 10)

/* How the queued H2D cuts a ring: *slots of *slot_bytes (a multiple of 64, at most
 * RS_STAGE_QUEUE_SLOT_BYTES and half the ring; slots * slot_bytes <= ring_bytes, so
 * rs_stage_device_bytes(ring_bytes) of device staging holds them). 0 when the ring is too
 * small for two slots of at least one sub-chunk. */
int rs_stage_h2d_queued_slots(int64_t ring_bytes, int64_t *slots, int64_t *slot_bytes);

/* The H2D staging loop of rs_cuda_stage for a table of ring rows only (no direct rows), with
 * the host's packing spread over `workers` threads (run by `parallel`) that take the ring's
 * chunks in sub-chunks of RS_STAGE_QUEUE_SUB_BYTES, in order: the thread that packs the last
 * sub-chunk of chunk k queues its DMA (and scatter) and records the slot's event; a thread
 * about to pack into a slot waits for the event of the slot's previous chunk. No thread waits
 * for the others between chunks, so packing, copies and the link overlap without a barrier
 * per slot. Same results, same stream order per slot and same return condition as
 * rs_cuda_stage (every host byte read when it returns); stats as there, for its slots. */
rs_status rs_cuda_stage_h2d_queued(const rs_stage_table *table, const rs_stage_buffers *buf,
                                   int64_t workers, rs_parallel_fn parallel, void *ctx,
                                   rs_stage_stats *stats, rs_error *err);

/* ---- page-locking live host memory in place ------------------------------------------- */

/* 1 if the device can DMA from/to [ptr, ptr + bytes) asynchronously: the first and the last
 * byte lie in pinned (cudaHostAlloc) or registered (cudaHostRegister) memory. */
int rs_cuda_is_pinned(const void *ptr, int64_t bytes);

/* cudaHostRegister(ptr, bytes, portable | mapped). *registered = 1 when this call registered
 * it; 0 when the range was already pinned or registered (nothing done, nothing to undo). */
rs_status rs_cuda_host_register(void *ptr, int64_t bytes, int *registered, rs_error *err);

/* cudaHostUnregister(ptr): undoes rs_cuda_host_register (ptr as registered). */
rs_status rs_cuda_host_unregister(void *ptr, rs_error *err);

#ifdef __cplusplus
}
#endif

#endif /* RESHARD_CUDA_H */
