/* reshard CUDA: the event-ordered staging loop between host and device buffers, and
 * in-place page-locking of live host memory. Host code only (CUDA runtime), no torch.
 *
 * H2D, chunk k in ring slot s = k mod S:
 *   host: wait ev[s] (the DMA that last read slot s) -> pack chunk k into ring[s]
 *   stream: DMA ring[s] -> staging[s]; record ev[s]; scatter staging[s] -> dst (kernel)
 * so the host packs chunk k while the DMAs of chunks k-S+1 .. k-1 are in flight.
 * D2H, chunk k in slot s:
 *   host: if slot s holds chunk k-S: wait ev[s] once, scatter ring[s] -> dst
 *   stream: gather src -> staging[s] (kernel); DMA staging[s] -> ring[s]; record ev[s]
 * Direct rows (pinned host side, equal dtypes, long runs) are plain async copies, issued
 * between ring chunks in proportion to their bytes.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "cuda_check.h"
#include "reshard_cuda.h"

extern "C" rs_dtype rs_stage_wire_dtype(rs_direction dir, rs_dtype s, rs_dtype d) {
  const size_t a = rs_dtype_size(s), b = rs_dtype_size(d);
  if (a < b) return s;
  if (b < a) return d;
  return dir == RS_H2D ? s : d; /* equal widths: any cast runs on the device */
}

extern "C" int rs_stage_row_is_direct(const rs_run *r, int64_t elem_size, int64_t min_bytes) {
  if (r->length <= 0 || r->count <= 0) return 0;
  if (r->length > INT64_MAX / elem_size) return 0;
  const int64_t run_bytes = r->length * elem_size;
  if (run_bytes < min_bytes) return 0;
  if (r->count == 1) return 1;
  /* cudaMemcpy2DAsync needs pitches >= width */
  return r->src_stride >= r->length && r->dst_stride >= r->length;
}

extern "C" rs_status rs_stage_slots(int64_t ring_bytes, int64_t *slots, int64_t *slot_bytes,
                                    rs_error *err) {
  if (ring_bytes < RS_STAGE_MIN_RING_BYTES)
    return rs_fail(err, RS_EINVAL, -1, -1,
                   "ring of %lld bytes is too small: at least %d bytes (two 16-byte slots)",
                   (long long)ring_bytes, RS_STAGE_MIN_RING_BYTES);
  /* Four slots keep three chunks in flight while the host packs the fourth; a small ring
   * is cut in fewer, larger slots, each at least 64 KiB where the ring allows. */
  int64_t s = RS_STAGE_MAX_SLOTS;
  while (s > 2 && ring_bytes / s < (int64_t)64 * 1024) --s;
  *slots = s;
  *slot_bytes = (ring_bytes / s) & ~(int64_t)15;
  return RS_OK;
}

extern "C" int64_t rs_stage_device_bytes(int64_t ring_bytes) {
  int64_t s = 0, b = 0;
  if (rs_stage_slots(ring_bytes, &s, &b, NULL) != RS_OK) return 0;
  return s * b;
}

namespace {

/* Events of calls that succeeded, kept per device for later calls: a queued call takes up to
 * seventeen, and creating and destroying nine cost ~20 us warm and ~75 us after a large copy
 * (H200 host). Never freed (destroying events at exit may outlive the CUDA context). */
constexpr size_t kEventPoolMax = 64;
std::mutex event_pool_mutex;
std::vector<std::pair<int, cudaEvent_t>> &event_pool() {
  static auto *pool = new std::vector<std::pair<int, cudaEvent_t>>();
  return *pool;
}

/* A call's events: taken from the pool (else created) on the current device; handed back
 * when the call succeeded (`keep`: every one is complete then), destroyed otherwise. */
struct Events {
  cudaEvent_t ev[RS_STAGE_QUEUE_MAX_SLOTS + 1];
  int n = 0;
  int device = -1;
  bool keep = false;
  ~Events() {
    if (!keep) {
      for (int i = 0; i < n; ++i) cudaEventDestroy(ev[i]);
      return;
    }
    std::lock_guard<std::mutex> lock(event_pool_mutex);
    auto &pool = event_pool();
    for (int i = 0; i < n; ++i) {
      if (pool.size() < kEventPoolMax)
        pool.emplace_back(device, ev[i]);
      else
        cudaEventDestroy(ev[i]);
    }
  }
  rs_status create(int count, rs_error *err) {
    if (device < 0) RS_CUDA_TRY("staging: cudaGetDevice", cudaGetDevice(&device), err);
    {
      std::lock_guard<std::mutex> lock(event_pool_mutex);
      auto &pool = event_pool();
      for (size_t i = pool.size(); i-- > 0 && n < count;) {
        if (pool[i].first != device) continue;
        ev[n++] = pool[i].second;
        pool[i] = pool.back();
        pool.pop_back();
      }
    }
    for (; n < count; ++n)
      RS_CUDA_TRY("staging: cudaEventCreateWithFlags",
                  cudaEventCreateWithFlags(&ev[n], cudaEventDisableTiming), err);
    return RS_OK;
  }
};

/* Issues direct row i (H2D or D2H) on the stream. */
rs_status issue_direct(rs_direction dir, const rs_run *r, const rs_stage_buffers *buf, int64_t es,
                       cudaStream_t st, rs_error *err) {
  const char *src = static_cast<const char *>(buf->src) + r->src_offset * es;
  char *dst = static_cast<char *>(buf->dst) + r->dst_offset * es;
  const cudaMemcpyKind kind = dir == RS_H2D ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  const size_t width = (size_t)(r->length * es);
  if (r->count == 1) {
    RS_CUDA_TRY(dir == RS_H2D ? "stage_h2d: cudaMemcpyAsync (direct)"
                              : "stage_d2h: cudaMemcpyAsync (direct)",
                cudaMemcpyAsync(dst, src, width, kind, st), err);
    return RS_OK;
  }
  const size_t spitch = (size_t)(r->src_stride * es), dpitch = (size_t)(r->dst_stride * es);
  RS_CUDA_TRY(dir == RS_H2D ? "stage_h2d: cudaMemcpy2DAsync (direct)"
                            : "stage_d2h: cudaMemcpy2DAsync (direct)",
              cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, (size_t)r->count, kind, st), err);
  return RS_OK;
}

int64_t run_bytes(const rs_run *r, int64_t es) { return r->length * r->count * es; }

}  // namespace

namespace {
rs_status stage_impl(rs_direction dir, const rs_stage_table *t, const rs_stage_buffers *buf,
                     rs_host_copy_fn host_copy, void *ctx, rs_stage_stats *stats, rs_error *err) {
  rs_stage_stats st_local;
  rs_stage_stats *so = stats ? stats : &st_local;
  memset(so, 0, sizeof *so);
  const char *op = dir == RS_H2D ? "stage_h2d" : "stage_d2h";
  if (dir != RS_H2D && dir != RS_D2H)
    return rs_fail(err, RS_EINVAL, -1, -1, "staging: bad direction");
  if (!t || !buf || !host_copy) return rs_fail(err, RS_EINVAL, -1, -1, "%s: null argument", op);
  const cudaStream_t stream = static_cast<cudaStream_t>(buf->stream);
  const int64_t es_direct = (int64_t)rs_dtype_size(buf->src_dtype);
  const rs_dtype wire = rs_stage_wire_dtype(dir, buf->src_dtype, buf->dst_dtype);
  const int64_t wes = (int64_t)rs_dtype_size(wire);
  if (!wes || !rs_dtype_pair_ok(buf->src_dtype, buf->dst_dtype))
    return rs_fail(err, RS_EDTYPE, -1, -1, "%s: unsupported dtype pair %s -> %s", op,
                   rs_dtype_name(buf->src_dtype), rs_dtype_name(buf->dst_dtype));
  if (t->n_direct > 0 && buf->src_dtype != buf->dst_dtype)
    return rs_fail(err, RS_EINVAL, -1, -1, "%s: direct rows need equal dtypes", op);

  int64_t direct_total = 0;
  for (int64_t i = 0; i < t->n_direct; ++i) direct_total += run_bytes(&t->direct[i], es_direct);

  int64_t slots = 0, slot_bytes = 0, slot_elems = 0, chunks = 0;
  if (t->total > 0) {
    rs_status s = rs_stage_slots(buf->ring_bytes, &slots, &slot_bytes, err);
    if (s != RS_OK) return s;
    if (!buf->ring || (!buf->staging && !t->device_dense))
      return rs_fail(err, RS_EINVAL, -1, -1, "%s: ring or device staging is null", op);
    if ((((uintptr_t)buf->ring) | ((uintptr_t)buf->staging)) & 15)
      return rs_fail(err, RS_EINVAL, -1, -1, "%s: ring and staging must be 16-byte aligned", op);
    slot_elems = slot_bytes / wes;
    chunks = (t->total + slot_elems - 1) / slot_elems;
  }
  so->slots = slots;
  so->slot_bytes = slot_bytes;

  Events ev;
  rs_status s = ev.create((int)slots + 1, err); /* + one final event */
  if (s != RS_OK) return s;
  char *ring = static_cast<char *>(buf->ring);
  char *staging = static_cast<char *>(buf->staging);

  /* Direct rows are interleaved: after ring chunk k is issued, issue direct rows until
   * their bytes reach the same fraction of direct_total as the ring has reached. */
  int64_t next_direct = 0, direct_done = 0;
  auto issue_directs_upto = [&](double frac) -> rs_status {
    while (next_direct < t->n_direct && (double)direct_done < frac * (double)direct_total) {
      const rs_run *r = &t->direct[next_direct++];
      rs_status e = issue_direct(dir, r, buf, es_direct, stream, err);
      if (e != RS_OK) return e;
      direct_done += run_bytes(r, es_direct);
      so->direct_bytes += run_bytes(r, es_direct);
      so->direct_copies += 1;
    }
    return RS_OK;
  };
  /* Direct rows start before any packing (at least one), so the link is busy at once. */
  s = issue_directs_upto(1.0 / (double)(chunks + 1));
  if (s != RS_OK) return s;

  /* chunk_of[s]: the chunk slot s holds whose host half is still pending (D2H), or -1 */
  int64_t pending[RS_STAGE_MAX_SLOTS];
  for (int i = 0; i < RS_STAGE_MAX_SLOTS; ++i) pending[i] = -1;

  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t sl = k % slots;
    const int64_t b = k * slot_elems;
    const int64_t e = (b + slot_elems < t->total) ? b + slot_elems : t->total;
    const size_t nbytes = (size_t)((e - b) * wes);
    char *ring_slot = ring + sl * slot_bytes;
    char *dev_slot = staging ? staging + sl * slot_bytes : nullptr;
    if (dir == RS_H2D) {
      if (k >= slots) { /* the DMA that read this slot (chunk k - slots) must be done */
        RS_CUDA_TRY("stage_h2d: cudaEventSynchronize (ring slot)", cudaEventSynchronize(ev.ev[sl]),
                    err);
        so->host_waits += 1;
      }
      s = host_copy(ctx, buf->src, buf->src_dtype, ring_slot, wire, t->runs, t->n, t->prefix, b, e,
                    RS_MODE_PACK);
      if (s != RS_OK)
        return rs_fail(err, s, -1, -1, "stage_h2d: host pack of a chunk failed (%s)",
                       rs_status_name(s));
      /* a dense target takes the slot as is; otherwise staging + one scatter kernel */
      char *to = t->device_dense ? static_cast<char *>(buf->dst) + b * wes : dev_slot;
      RS_CUDA_TRY("stage_h2d: cudaMemcpyAsync (ring -> device)",
                  cudaMemcpyAsync(to, ring_slot, nbytes, cudaMemcpyHostToDevice, stream), err);
      RS_CUDA_TRY("stage_h2d: cudaEventRecord", cudaEventRecord(ev.ev[sl], stream), err);
      if (!t->device_dense) {
        s = rs_cuda_copy_slice(dev_slot, wire, buf->dst, buf->dst_dtype, t->d_runs, t->n,
                               t->d_prefix, b, e, RS_MODE_UNPACK, buf->stream, err);
        if (s != RS_OK) return s;
      }
      if (buf->progress && t->n_direct == 0) rs_progress_publish(buf->progress, e);
    } else {
      if (pending[sl] >= 0) { /* slot s holds chunk k - slots: finish it on the host */
        const int64_t pb = pending[sl] * slot_elems;
        const int64_t pe = (pb + slot_elems < t->total) ? pb + slot_elems : t->total;
        RS_CUDA_TRY("stage_d2h: cudaEventSynchronize (ring slot)", cudaEventSynchronize(ev.ev[sl]),
                    err);
        so->host_waits += 1;
        s = host_copy(ctx, ring_slot, wire, buf->dst, buf->dst_dtype, t->runs, t->n, t->prefix, pb,
                      pe, RS_MODE_UNPACK);
        if (s != RS_OK)
          return rs_fail(err, s, -1, -1, "stage_d2h: host scatter of a chunk failed (%s)",
                         rs_status_name(s));
        pending[sl] = -1;
      }
      const char *from = dev_slot;
      if (t->device_dense) {
        from = static_cast<const char *>(buf->src) + b * wes;
      } else {
        s = rs_cuda_copy_slice(buf->src, buf->src_dtype, dev_slot, wire, t->d_runs, t->n,
                               t->d_prefix, b, e, RS_MODE_PACK, buf->stream, err);
        if (s != RS_OK) return s;
      }
      RS_CUDA_TRY("stage_d2h: cudaMemcpyAsync (device -> ring)",
                  cudaMemcpyAsync(ring_slot, from, nbytes, cudaMemcpyDeviceToHost, stream), err);
      RS_CUDA_TRY("stage_d2h: cudaEventRecord", cudaEventRecord(ev.ev[sl], stream), err);
      pending[sl] = k;
    }
    so->chunks += 1;
    so->ring_bytes += (int64_t)nbytes;
    s = issue_directs_upto((double)(k + 2) / (double)(chunks + 1));
    if (s != RS_OK) return s;
  }
  s = issue_directs_upto(2.0); /* whatever is left */
  if (s != RS_OK) return s;

  if (dir == RS_D2H) { /* finish the chunks still in the ring, oldest first */
    for (int64_t k = chunks > slots ? chunks - slots : 0; k < chunks; ++k) {
      const int64_t sl = k % slots;
      if (pending[sl] != k) continue;
      const int64_t pb = k * slot_elems;
      const int64_t pe = (pb + slot_elems < t->total) ? pb + slot_elems : t->total;
      RS_CUDA_TRY("stage_d2h: cudaEventSynchronize (ring slot)", cudaEventSynchronize(ev.ev[sl]),
                  err);
      so->host_waits += 1;
      s = host_copy(ctx, ring + sl * slot_bytes, wire, buf->dst, buf->dst_dtype, t->runs, t->n,
                    t->prefix, pb, pe, RS_MODE_UNPACK);
      if (s != RS_OK)
        return rs_fail(err, s, -1, -1, "stage_d2h: host scatter of a chunk failed (%s)",
                       rs_status_name(s));
      pending[sl] = -1;
    }
  }
  /* Every host byte must be settled before returning: the H2D source and ring may be
   * rewritten by the caller, a D2H target read. One wait covers all earlier copies. */
  if (so->direct_copies > 0 || (dir == RS_H2D && chunks > 0)) {
    RS_CUDA_TRY("staging: cudaEventRecord (final)", cudaEventRecord(ev.ev[slots], stream), err);
    RS_CUDA_TRY("staging: cudaEventSynchronize (final)", cudaEventSynchronize(ev.ev[slots]), err);
    so->host_waits += 1;
  }
  ev.keep = true;
  return RS_OK;
}

}  // namespace

extern "C" rs_status rs_cuda_stage(rs_direction dir, const rs_stage_table *t,
                                   const rs_stage_buffers *buf, rs_host_copy_fn host_copy,
                                   void *ctx, rs_stage_stats *stats, rs_error *err) {
  rs_status s = stage_impl(dir, t, buf, host_copy, ctx, stats, err);
  if (s != RS_OK && buf) {
    /* Copies already queued may still read or write the ring and the host buffers: let them
     * finish before the caller can free or reuse those (best effort: the stream may be
     * broken, and then the error above is what matters). */
    cudaStreamSynchronize(static_cast<cudaStream_t>(buf->stream));
  }
  return s;
}

/* ---- H2D as one queue of sub-chunks over the host's threads ------------------------------ */

namespace {

/* One call's shared state. Chunk k (slot k mod slots) is packed in sub-chunks that any worker
 * claims in order; the worker that finishes the last sub-chunk of chunk k issues its DMA (and
 * scatter), records the slot's event and marks the chunk issued. A worker about to pack into
 * a slot first waits until the slot's previous chunk was issued, then for its event. */
struct Queue {
  const rs_stage_table *t;
  const rs_stage_buffers *buf;
  rs_dtype wire;
  int64_t wes, slots, slot_bytes, slot_elems, sub_elems, subs_per_chunk, chunks, subs;
  int device;
  Events events; /* one per slot and the final one */
  std::atomic<int64_t> next_sub{0};
  std::unique_ptr<std::atomic<int64_t>[]> left; /* per chunk: sub-chunks not yet packed */
  std::unique_ptr<std::atomic<int>[]> issued;   /* per chunk: its DMA is queued */
  std::unique_ptr<std::atomic<int>[]> freed;    /* per chunk: its DMA completed */
  std::mutex front_mutex;
  int64_t front = 0; /* chunks [0, front) are all issued (published to buf->progress) */
  std::atomic<int64_t> host_waits{0};
  std::atomic<int> failed{0};
  std::mutex err_mutex;
  rs_error first_err;
  rs_status first_status = RS_OK;
};

void queue_fail(Queue *q, rs_status s, const rs_error &e) {
  std::lock_guard<std::mutex> lock(q->err_mutex);
  if (q->first_status == RS_OK) {
    q->first_status = s;
    q->first_err = e;
  }
  q->failed.store(1, std::memory_order_release);
}

/* Queues chunk k: its DMA (straight into a dense target, else into device staging and one
 * scatter kernel), then the slot's event. */
rs_status queue_issue(Queue *q, int64_t k, rs_error *err) {
  const rs_stage_table *t = q->t;
  const int64_t sl = k % q->slots;
  const int64_t b = k * q->slot_elems;
  const int64_t e = (b + q->slot_elems < t->total) ? b + q->slot_elems : t->total;
  const cudaStream_t stream = static_cast<cudaStream_t>(q->buf->stream);
  char *ring_slot = static_cast<char *>(q->buf->ring) + sl * q->slot_bytes;
  char *dev_slot =
      q->buf->staging ? static_cast<char *>(q->buf->staging) + sl * q->slot_bytes : nullptr;
  char *to = t->device_dense ? static_cast<char *>(q->buf->dst) + b * q->wes : dev_slot;
  RS_CUDA_TRY(
      "stage_h2d: cudaMemcpyAsync (ring -> device)",
      cudaMemcpyAsync(to, ring_slot, (size_t)((e - b) * q->wes), cudaMemcpyHostToDevice, stream),
      err);
  if (!t->device_dense) {
    rs_status s = rs_cuda_copy_slice(dev_slot, q->wire, q->buf->dst, q->buf->dst_dtype, t->d_runs,
                                     t->n, t->d_prefix, b, e, RS_MODE_UNPACK, q->buf->stream, err);
    if (s != RS_OK) return s;
  }
  RS_CUDA_TRY("stage_h2d: cudaEventRecord", cudaEventRecord(q->events.ev[sl], stream), err);
  return RS_OK;
}

/* Chunks are issued in the order their packing ends: publishes the end of the longest prefix
 * of chunks all issued, whenever it grows. */
void queue_publish(Queue *q) {
  std::lock_guard<std::mutex> lock(q->front_mutex);
  const int64_t before = q->front;
  while (q->front < q->chunks && q->issued[q->front].load(std::memory_order_acquire)) ++q->front;
  if (q->front == before) return;
  const int64_t end = q->front * q->slot_elems;
  rs_progress_publish(q->buf->progress, end < q->t->total ? end : q->t->total);
}

/* Before packing into the slot of chunk k: chunk k - slots, its previous user, was issued
 * and its DMA (and scatter) completed. */
rs_status queue_wait_slot(Queue *q, int64_t k, rs_error *err) {
  if (k < q->slots) return RS_OK;
  const int64_t prev = k - q->slots;
  if (q->freed[prev].load(std::memory_order_acquire)) return RS_OK;
  while (!q->issued[prev].load(std::memory_order_acquire)) {
    if (q->failed.load(std::memory_order_acquire)) return RS_EDEVICE;
    std::this_thread::yield();
  }
  RS_CUDA_TRY("stage_h2d: cudaEventSynchronize (ring slot)",
              cudaEventSynchronize(q->events.ev[prev % q->slots]), err);
  int expected = 0;
  if (q->freed[prev].compare_exchange_strong(expected, 1, std::memory_order_acq_rel))
    q->host_waits.fetch_add(1, std::memory_order_relaxed);
  return RS_OK;
}

void queue_worker(void *arg, int64_t /*worker*/) {
  Queue *q = static_cast<Queue *>(arg);
  const rs_stage_table *t = q->t;
  int prev_device = -1;
  rs_error err;
  if (cudaGetDevice(&prev_device) != cudaSuccess || prev_device != q->device) {
    cudaError_t e = cudaSetDevice(q->device);
    if (e != cudaSuccess) {
      rs_cuda_fail(&err, "stage_h2d: cudaSetDevice (worker)", e);
      queue_fail(q, RS_EDEVICE, err);
      return;
    }
  }
  while (!q->failed.load(std::memory_order_acquire)) {
    const int64_t j = q->next_sub.fetch_add(1, std::memory_order_relaxed);
    if (j >= q->subs) break;
    const int64_t k = j / q->subs_per_chunk;
    const int64_t cb = k * q->slot_elems;
    const int64_t ce = (cb + q->slot_elems < t->total) ? cb + q->slot_elems : t->total;
    const int64_t b = cb + (j % q->subs_per_chunk) * q->sub_elems;
    const int64_t e = (b + q->sub_elems < ce) ? b + q->sub_elems : ce;
    rs_status s = queue_wait_slot(q, k, &err);
    if (s != RS_OK) {
      if (!q->failed.load(std::memory_order_acquire)) queue_fail(q, s, err);
      break;
    }
    char *ring_slot = static_cast<char *>(q->buf->ring) + (k % q->slots) * q->slot_bytes;
    s = rs_copy_slice(q->buf->src, q->buf->src_dtype, ring_slot + (b - cb) * q->wes, q->wire,
                      t->runs, t->n, t->prefix, b, e, RS_MODE_PACK);
    if (s != RS_OK) {
      rs_fail(&err, s, -1, -1, "stage_h2d: host pack of a chunk failed (%s)", rs_status_name(s));
      queue_fail(q, s, err);
      break;
    }
    if (q->left[k].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      s = queue_issue(q, k, &err);
      if (s != RS_OK) {
        queue_fail(q, s, err);
        break;
      }
      q->issued[k].store(1, std::memory_order_release);
      if (q->buf->progress) queue_publish(q);
    }
  }
  if (prev_device >= 0 && prev_device != q->device) cudaSetDevice(prev_device);
}

rs_status stage_h2d_queued_impl(Queue &q, const rs_stage_table *t, const rs_stage_buffers *buf,
                                int64_t workers, rs_parallel_fn parallel, void *ctx,
                                rs_stage_stats *so, rs_error *err) {
  q.t = t;
  q.buf = buf;
  q.wire = rs_stage_wire_dtype(RS_H2D, buf->src_dtype, buf->dst_dtype);
  q.wes = (int64_t)rs_dtype_size(q.wire);
  if (!q.wes || !rs_dtype_pair_ok(buf->src_dtype, buf->dst_dtype))
    return rs_fail(err, RS_EDTYPE, -1, -1, "stage_h2d: unsupported dtype pair %s -> %s",
                   rs_dtype_name(buf->src_dtype), rs_dtype_name(buf->dst_dtype));
  if (t->n_direct > 0 || !rs_stage_h2d_queued_slots(buf->ring_bytes, &q.slots, &q.slot_bytes))
    return rs_fail(err, RS_EINVAL, -1, -1,
                   "stage_h2d: queued staging needs ring rows only and "
                   "a ring of at least two queue slots");
  if (!buf->ring || (!buf->staging && !t->device_dense))
    return rs_fail(err, RS_EINVAL, -1, -1, "stage_h2d: ring or device staging is null");
  if ((((uintptr_t)buf->ring) | ((uintptr_t)buf->staging)) & 15)
    return rs_fail(err, RS_EINVAL, -1, -1, "stage_h2d: ring and staging must be 16-byte aligned");
  RS_CUDA_TRY("stage_h2d: cudaGetDevice", cudaGetDevice(&q.device), err);
  q.slot_elems = q.slot_bytes / q.wes;
  q.sub_elems = RS_STAGE_QUEUE_SUB_BYTES / q.wes;
  if (q.sub_elems > q.slot_elems) q.sub_elems = q.slot_elems;
  q.subs_per_chunk = (q.slot_elems + q.sub_elems - 1) / q.sub_elems;
  q.chunks = (t->total + q.slot_elems - 1) / q.slot_elems;
  const int64_t last = t->total - (q.chunks - 1) * q.slot_elems;
  q.subs = (q.chunks - 1) * q.subs_per_chunk + (last + q.sub_elems - 1) / q.sub_elems;
  q.left.reset(new std::atomic<int64_t>[q.chunks]);
  q.issued.reset(new std::atomic<int>[q.chunks]);
  q.freed.reset(new std::atomic<int>[q.chunks]);
  for (int64_t k = 0; k < q.chunks; ++k) {
    const int64_t n = k + 1 < q.chunks ? q.slot_elems : last;
    q.left[k].store((n + q.sub_elems - 1) / q.sub_elems, std::memory_order_relaxed);
    q.issued[k].store(0, std::memory_order_relaxed);
    q.freed[k].store(0, std::memory_order_relaxed);
  }
  so->slots = q.slots;
  so->slot_bytes = q.slot_bytes;
  const cudaStream_t stream = static_cast<cudaStream_t>(buf->stream);
  q.events.device = q.device;
  rs_status s = q.events.create((int)q.slots + 1, err);
  if (s == RS_OK) {
    /* any CUDA call of a worker, or a worker's own thread start, may fail: each failure is
     * kept (the first one is returned) and stops the others at their next sub-chunk */
    parallel(ctx, workers, queue_worker, &q);
    if (q.first_status != RS_OK) {
      *err = q.first_err;
      s = q.first_status;
    }
  }
  if (s == RS_OK) {
    so->chunks = q.chunks;
    so->ring_bytes = t->total * q.wes;
    so->host_waits = q.host_waits.load() + 1;
    /* every chunk was issued by the worker that packed its last sub-chunk; one wait covers
     * them all: the ring and the source may be rewritten once this returns */
    cudaError_t e = cudaEventRecord(q.events.ev[q.slots], stream);
    if (e == cudaSuccess) e = cudaEventSynchronize(q.events.ev[q.slots]);
    if (e != cudaSuccess) s = rs_cuda_fail(err, "stage_h2d: final event", e);
  }
  q.events.keep = s == RS_OK; /* then every event is complete */
  return s;
}

}  // namespace

extern "C" int rs_stage_h2d_queued_slots(int64_t ring_bytes, int64_t *slots, int64_t *slot_bytes) {
  int64_t b = RS_STAGE_QUEUE_SLOT_BYTES;
  if (ring_bytes / 2 < b) b = (ring_bytes / 2) & ~(int64_t)63;
  if (b < RS_STAGE_QUEUE_SUB_BYTES) return 0;
  int64_t s = ring_bytes / b;
  if (s > RS_STAGE_QUEUE_MAX_SLOTS) s = RS_STAGE_QUEUE_MAX_SLOTS;
  *slots = s;
  *slot_bytes = b;
  return 1;
}

extern "C" rs_status rs_cuda_stage_h2d_queued(const rs_stage_table *t, const rs_stage_buffers *buf,
                                              int64_t workers, rs_parallel_fn parallel, void *ctx,
                                              rs_stage_stats *stats, rs_error *err) {
  rs_stage_stats st_local;
  rs_stage_stats *so = stats ? stats : &st_local;
  memset(so, 0, sizeof *so);
  if (!t || !buf || !parallel || workers < 1)
    return rs_fail(err, RS_EINVAL, -1, -1, "stage_h2d: null argument or no workers");
  if (t->total == 0) return RS_OK;
  Queue q;
  rs_status s = stage_h2d_queued_impl(q, t, buf, workers, parallel, ctx, so, err);
  if (s != RS_OK) cudaStreamSynchronize(static_cast<cudaStream_t>(buf->stream));
  return s;
}

/* ---- registration ---------------------------------------------------------------------- */

namespace {
int one_pinned(const void *p) {
  cudaPointerAttributes a;
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError(); /* unregistered pointers may report an error on old runtimes */
    return 0;
  }
  return a.type == cudaMemoryTypeHost;
}
}  // namespace

extern "C" int rs_cuda_is_pinned(const void *ptr, int64_t bytes) {
  if (!ptr || bytes <= 0) return 0;
  return one_pinned(ptr) && one_pinned(static_cast<const char *>(ptr) + (bytes - 1));
}

extern "C" rs_status rs_cuda_host_register(void *ptr, int64_t bytes, int *registered,
                                           rs_error *err) {
  if (registered) *registered = 0;
  if (!ptr || bytes <= 0)
    return rs_fail(err, RS_EINVAL, -1, -1, "host_register: null pointer or empty range");
  if (rs_cuda_is_pinned(ptr, bytes)) return RS_OK;
  cudaError_t e =
      cudaHostRegister(ptr, (size_t)bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (e == cudaErrorHostMemoryAlreadyRegistered) {
    cudaGetLastError();
    return RS_OK;
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return rs_cuda_fail(err, "host_register: cudaHostRegister", e);
  }
  if (registered) *registered = 1;
  return RS_OK;
}

extern "C" rs_status rs_cuda_host_unregister(void *ptr, rs_error *err) {
  if (!ptr) return rs_fail(err, RS_EINVAL, -1, -1, "host_unregister: null pointer");
  cudaError_t e = cudaHostUnregister(ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return rs_cuda_fail(err, "host_unregister: cudaHostUnregister", e);
  }
  return RS_OK;
}
