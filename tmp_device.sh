. bench/device_setup.sh >/dev/null
python3 -m pytest tests/kernels/test_triton_gemv_smem.py -m gpu -rA -q -p no:cacheprovider 2>&1 | grep -E "PASSED|FAILED|ERROR|Error|assert" | head -30
python3 bench/gemv_overlap_probe.py --out $OUT/gemv-overlap-probe.json 2>&1 | tail -20
python3 -m pytest tests/kernels/test_triton_gemv.py tests/pipeline/runner/test_exact_rows.py -m gpu -rA -q -p no:cacheprovider 2>&1 | grep -E "FAILED|ERROR|passed|failed" | head -10; echo rc=${PIPESTATUS[0]}
VARIANTS="CONVEYOR_GEMV_SMEM=0 CONVEYOR_GEMV_SMEM=1" bash bench/launch_ab.sh $COMMIT qwen3-30b-a3b qwen3.5-35b-a3b
