#!/usr/bin/env bash
# Session 13 call A: the host cast probe (kernel variants, threads, pages, with a DMA).
set -u
R=$OUT/s13a; mkdir -p $R
{ date -u; nproc; lscpu | head -30; cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; uptime; } >$R/env.txt 2>&1
nvcc -O3 -std=c++17 -Xcompiler -fopenmp -Xcompiler -O3 .devscripts/s13/cast_probe.cu -o /tmp/cast_probe -lgomp >$R/build.log 2>&1; echo "build rc=$?"
for i in 1 2; do timeout 120 /tmp/cast_probe 5 >$R/probe$i.log 2>&1; echo "probe$i rc=$?"; done
cat $R/probe1.log; echo ---; cat $R/probe2.log
