/* reshard C core: whether a write to host memory would fault, read from a memory map in the
 * format of Linux's /proc/<pid>/maps (see reshard.h). Plain C11: the map is read with stdio. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reshard.h"

/* Longer lines (a path near PATH_MAX) are read up to this and the rest skipped: only the
 * message's file name is cut. */
#define LINE_BYTES 1024

/* Reads one line into buf (at most LINE_BYTES - 1 characters, no newline); skips the rest of a
 * longer one. 0 at the end of the file. */
static int read_line(FILE *f, char *buf) {
  if (!fgets(buf, LINE_BYTES, f)) return 0;
  const size_t len = strlen(buf);
  if (len > 0 && buf[len - 1] == '\n') {
    buf[len - 1] = '\0';
  } else {
    int c;
    while ((c = fgetc(f)) != EOF && c != '\n') {
    }
  }
  return 1;
}

/* Parses "lo-hi perms offset dev inode [path]"; 0 when the line is not that. */
static int parse_line(char *line, uint64_t *lo, uint64_t *hi, const char **perms,
                      const char **path) {
  char *end;
  *lo = strtoull(line, &end, 16);
  if (end == line || *end != '-') return 0;
  char *p = end + 1;
  *hi = strtoull(p, &end, 16);
  if (end == p || *end != ' ' || *hi < *lo) return 0;
  p = end + 1;
  *perms = p;
  p = strchr(p, ' ');
  if (!p || p - *perms < 2) return 0;
  *p++ = '\0';
  for (int field = 0; field < 3; ++field) { /* offset, device, inode */
    p += strspn(p, " ");
    p += strcspn(p, " ");
  }
  *path = p + strspn(p, " ");
  return 1;
}

int rs_unwritable_byte(const char *map_path, uintptr_t addr, uint64_t nbytes, uint64_t *offset,
                       char *what, size_t what_len) {
  FILE *f = fopen(map_path, "r");
  if (!f) return -1;
  char line[LINE_BYTES];
  /* the range ends past UINTPTR_MAX only for a bad argument: the last address counts as mapped
   * nowhere then */
  const uint64_t first = (uint64_t)addr;
  const uint64_t stop = nbytes > UINT64_MAX - first ? UINT64_MAX : first + nbytes;
  uint64_t at = first;
  int read_only = 0;
  const char *perms = "", *path = "";
  while (at < stop && read_line(f, line)) {
    uint64_t lo, hi;
    if (!parse_line(line, &lo, &hi, &perms, &path)) continue;
    if (hi <= at) continue;
    if (lo > at) break; /* a gap: nothing is mapped at `at` (the map is in address order) */
    if (perms[1] != 'w') {
      read_only = 1;
      break;
    }
    at = hi;
  }
  fclose(f);
  if (at >= stop) return 0;
  *offset = at - first;
  if (read_only)
    snprintf(what, what_len, "read-only memory: mapped %s%s%s", perms, *path ? " from " : "", path);
  else
    snprintf(what, what_len, "no memory is mapped there");
  return 1;
}
