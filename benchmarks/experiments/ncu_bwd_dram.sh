#!/usr/bin/env bash
# DRAM and L2->SM bytes, local-memory (spill) loads and their L1 misses of the one-launch backward
# (_attn_bwd) per A/B variant, under ncu.
#   bash benchmarks/experiments/ncu_bwd_dram.sh OUTDIR PATTERN VARIANT...
set -u
out=$1; pat=$2; shift 2
NCU=${NCU:-/usr/local/cuda/bin/ncu}
for v in "$@"; do
  $NCU --clock-control none --cache-control all --profile-from-start off --target-processes all \
    --kernel-name regex:'^_attn_(fwd|bwd)$' --csv --page raw \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,l1tex__m_xbar2l1tex_read_bytes.sum,gpu__time_duration.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_miss.sum \
    python benchmarks/experiments/ab_variants.py worker --pattern "$pat" --variant "$v" > "$out/ncu_${pat}_${v}.csv" 2> "$out/ncu_${pat}_${v}.err"
  echo "== $pat $v"; grep -E '"_attn_(fwd|bwd)"' "$out/ncu_${pat}_${v}.csv" | cut -c1-600 | tail -2
done
