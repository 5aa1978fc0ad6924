#!/bin/bash
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv
timeout 200 python3 -m pytest -q -x tests/kernels/test_matmul_fp8_block.py -k "cuda" -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/tests.txt
timeout 300 python3 benchmarks/config_sweep.py matmul_fp8_block_cuda 2>&1 | tee $OUT/sweep.txt
cp out/config-sweep.jsonl $OUT/
