/* reshard C core: how the queued H2D cuts a table into ring chunks and the sub-chunks its
 * threads claim (see reshard.h). Pure arithmetic, so the CPU tests check it under ASan/UBSan. */
#include <stdint.h>

#include "reshard.h"

/* Tail sub-chunk sizes double from `least` (checked arithmetic is not needed: every size stays
 * below `sub`), so at most this many levels below any int64 `sub`. */
#define RS_CUTS_MAX_LEVELS 64

typedef struct cuts_out {
  int64_t *chunk_begin, *sub_begin, *sub_chunk;
  int64_t chunks, subs;
} cuts_out;

/* Appends one chunk [b, b + len) packed in sub-chunks of `piece` elements (the last shorter). */
static void emit_chunk(cuts_out *o, int64_t b, int64_t len, int64_t piece) {
  int64_t p;
  if (o->chunk_begin) o->chunk_begin[o->chunks] = b;
  for (p = 0; p < len; p += piece) {
    if (o->sub_begin) o->sub_begin[o->subs] = b + p;
    if (o->sub_chunk) o->sub_chunk[o->subs] = o->chunks;
    o->subs++;
  }
  o->chunks++;
}

rs_status rs_stage_cuts(int64_t total, int64_t slot, int64_t sub, int64_t least, int64_t align,
                        int64_t workers, int64_t *chunk_begin, int64_t *sub_begin,
                        int64_t *sub_chunk, int64_t *chunks, int64_t *subs) {
  int64_t level[RS_CUTS_MAX_LEVELS], used[RS_CUTS_MAX_LEVELS];
  int64_t nlevels = 0, tail = 0, pos, i, s;
  cuts_out o;
  if (!chunks || !subs || total < 0 || align < 1 || least < 1 || workers < 1) return RS_EINVAL;
  if (least % align || sub % align || slot % align || least > sub || sub > slot) return RS_EINVAL;
  if (total > INT64_MAX - slot) return RS_EOVERFLOW; /* the chunk loop steps past total */
  /* the tail's levels, from the table's end: sub-chunks of s elements, a chunk of up to
   * `workers` of them (at most a slot); the level that reaches the table's start is cut */
  for (s = least; s < sub && tail < total; ++nlevels) {
    const int64_t per = slot / s < workers ? slot / s : workers;
    if (nlevels == RS_CUTS_MAX_LEVELS) return RS_EINVAL; /* unreachable: sizes double */
    level[nlevels] = s;
    used[nlevels] = total - tail < per * s ? total - tail : per * s;
    tail += used[nlevels];
    s = s > sub / 2 ? sub : 2 * s; /* a multiple of align too */
  }
  o.chunk_begin = chunk_begin;
  o.sub_begin = sub_begin;
  o.sub_chunk = sub_chunk;
  o.chunks = o.subs = 0;
  for (pos = 0; pos < total - tail; pos += slot)
    emit_chunk(&o, pos, total - tail - pos < slot ? total - tail - pos : slot, sub);
  for (i = nlevels - 1, pos = total - tail; i >= 0; pos += used[i--])
    emit_chunk(&o, pos, used[i], level[i]);
  if (chunk_begin) chunk_begin[o.chunks] = total;
  if (sub_begin) sub_begin[o.subs] = total;
  *chunks = o.chunks;
  *subs = o.subs;
  return RS_OK;
}
