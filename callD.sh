#!/bin/bash
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv
timeout 280 python3 -m pytest -q -n 8 tests/kernels/test_matmul_fp8_block.py -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/tests.txt
timeout 280 python3 -m tkit.cli bench matmul_fp8 --out $OUT 2>&1 | tail -60 | tee $OUT/bench.txt
