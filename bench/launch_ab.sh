#!/usr/bin/env bash
# B1 and the decode-step profile (batch 1/16/64/256, top kernels at batch 1) of both MoE shapes under each launch
# choice, one machine, one device call: ordinary launches (pdl-off: CONVEYOR_PDL=0), dependent launch (pdl, the
# default), with L2 weight hints (l2: CONVEYOR_L2_HINTS=1), with the GDN conv inside the delta-rule kernel (conv,
# Qwen3.5 only: CONVEYOR_CONV_IN_DELTA_RULE=1), both (all); OFF too for pdl-off and pdl. JSON per run under $OUT.
#   . bench/device_setup.sh && VARIANTS="pdl l2" bash bench/launch_ab.sh <commit> [shape ...]
set -u
commit=${1:?commit}
shift
shapes=${*:-qwen3-30b-a3b qwen3.5-35b-a3b}
skip="correctness graphs verify kernels serve peer moe"  # OFF too: a batch's steps must not lose to PDL
for shape in $shapes; do
  for variant in ${VARIANTS:-pdl-off pdl l2}; do
    case $variant in
      pdl-off) flags=(CONVEYOR_PDL=0) ;;
      pdl) flags=() ;;
      l2) flags=(CONVEYOR_L2_HINTS=1) ;;
      conv) flags=(CONVEYOR_CONV_IN_DELTA_RULE=1) ;;
      all) flags=(CONVEYOR_L2_HINTS=1 CONVEYOR_CONV_IN_DELTA_RULE=1) ;;
    esac
    off=""
    case $variant in pdl-off|pdl) ;; *) off="off" ;; esac  # OFF for the launch A/B, not for each option
    if [ "$variant" = conv ] && [ "$shape" != qwen3.5-35b-a3b ]; then continue; fi  # no Gated DeltaNet there
    env "${flags[@]}" python3 bench/gpu.py --shape "$shape" --skip $skip $off --commit "$commit" \
      --out "${OUT:-/tmp}/launch-ab-$shape-$variant.json" 2>&1 | tail -1
  done
done
python3 - "${OUT:-/tmp}" "${VARIANTS:-pdl-off pdl l2}" $shapes <<'PY'
import json, os, sys
out, variants, shapes = sys.argv[1], sys.argv[2].split(), sys.argv[3:]
for shape in shapes:
    for variant in variants:
        path = os.path.join(out, f"launch-ab-{shape}-{variant}.json")
        if not os.path.exists(path):
            print(shape, variant, "missing")
            continue
        d = json.load(open(path))
        b1, steps = d.get("b1", {}), d.get("steps", {})
        replay = {k: round(v["graph_replay_ms"], 3) for k, v in steps.items()
                  if isinstance(v, dict) and "graph_replay_ms" in v}
        off = d.get("off", {})
        print(shape, variant, round(b1.get("tok_s", 0), 1), round(b1.get("frac_of_limit", 0), 3), replay,
              "OFF", round(off.get("output_tok_s", 0)), d.get("errors"))
PY
