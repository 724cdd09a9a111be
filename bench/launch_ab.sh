#!/usr/bin/env bash
# B1 and the decode-step profile (batch 1/16/64/256, top kernels at batch 1) of both MoE shapes under each launch
# choice, one machine, one device call: ordinary launches (pdl-off: CONVEYOR_PDL=0), dependent launch (pdl, the
# default, and OFF for both), or any option given as NAME=VALUE[,NAME=VALUE] (an environment a run starts with).
# JSON per run under $OUT.
#   . bench/device_setup.sh && VARIANTS="pdl CONVEYOR_NORM_IN_PROJECTION=0" bash bench/launch_ab.sh <commit> [shape ...]
set -u
commit=${1:?commit}
shift
shapes=${*:-qwen3-30b-a3b qwen3.5-35b-a3b}
variants=${VARIANTS:-pdl-off pdl}
skip="correctness graphs verify kernels serve peer moe"  # "off" joins it for an option
name() { echo "$1" | tr '=,' '-_'; }  # a file name the device copy brings back (no '=')
for shape in $shapes; do
  for variant in $variants; do
    case $variant in
      pdl-off) flags=(CONVEYOR_PDL=0); off="" ;;  # OFF too: a batch's steps must not lose to dependent launch
      pdl) flags=(); off="" ;;
      *=*) IFS=, read -r -a flags <<< "$variant"; off="off" ;;  # an option: B1 and the steps only
      *) echo "unknown variant $variant"; exit 2 ;;
    esac
    env "${flags[@]}" python3 bench/gpu.py --shape "$shape" --skip $skip $off --commit "$commit" \
      --out "${OUT:-/tmp}/launch-ab-$shape-$(name "$variant").json" 2>&1 | tail -1
  done
done
python3 - "${OUT:-/tmp}" "$variants" $shapes <<'PY'
import json, os, sys
out, variants, shapes = sys.argv[1], sys.argv[2].split(), sys.argv[3:]
for shape in shapes:
    for variant in variants:
        path = os.path.join(out, f"launch-ab-{shape}-{variant.replace('=', '-').replace(',', '_')}.json")
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
