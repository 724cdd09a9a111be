#!/usr/bin/env bash
# One device call (2026-11-22): the documented GPU install, kernel tests on real Triton, Cython twins,
# CPU-vs-GPU engine agreement and a first engine timing. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1; echo "install rc=$?" | tee -a $OUT/gpu.txt
PY=python3
$PY -c "import ext, torch, triton; print('cython compiled:', ext.is_compiled('step_inputs'), 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
$PY -m pytest tests/kernels tests/ext -q -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/kernel_tests.txt
$PY - <<'PYEOF' 2>&1 | tee $OUT/kernel_bench.txt
import json, torch
from kernels.bench_attention import bench_decode_attention, bench_prefill_attention
rows = [bench_decode_attention(batch_size=b, context_len=c) for b, c in ((1, 4096), (16, 2048), (64, 4096), (256, 1024))]
rows += [bench_prefill_attention(num_seqs=n, prompt_len=p, prefix_len=q) for n, p, q in ((1, 4096, 0), (4, 2048, 0), (8, 512, 1536))]
x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(True), torch.cuda.Event(True); torch.cuda.synchronize(); s.record()
for _ in range(20): y.copy_(x)
e.record(); torch.cuda.synchronize(); copy_gbps = 2 * x.numel() * 20 / (s.elapsed_time(e) / 1e3) / 1e9
print(json.dumps({"copy_GBps": copy_gbps, "rows": rows}, indent=1))
for r in rows: print(r["kernel"], {k: r[k] for k in r if k in ("batch_size", "context_len", "num_seqs", "prompt_len", "prefix_len", "num_splits", "time_ms", "gbps", "tflops", "max_abs_err")})
PYEOF
timeout 300 $PY bench/gpu_smoke.py --tokenizer .peer/tokenizer --out $OUT/gpu_smoke.json 2>&1 | tail -25
