export PYTHONPATH=$PWD
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
( timeout 300 $SAN --tool racecheck --racecheck-report hazard --print-limit 100000 python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_attention_hopper.py -k "test_gpu_gqa_head_dims_dtypes and dtype0 and 16-4 and (128 or 256) and not persistent2" > /tmp/race_d128.log 2>&1; echo rc=$? >> /tmp/race_d128.log
  { grep -h "RACECHECK SUMMARY\|passed\|failed\|rc=" /tmp/race_d128.log; grep -o "at [^ ]* in [^ ]*_hopper_kernels.py:[0-9]*" /tmp/race_d128.log | sort | uniq -c; grep -c "Potential" /tmp/race_d128.log; } > $OUT/race_d128.txt ) &
timeout 420 python3 -m pytest -n 8 -q -p no:cacheprovider tests/kernels/test_attention_hopper.py tests/kernels/test_attention.py -k "not fuzz" > $OUT/tests.log 2>&1; echo tests rc=$?
wait
tail -3 $OUT/tests.log; grep -E "FAILED|ERROR" $OUT/tests.log | head
cat $OUT/race_d128.txt
