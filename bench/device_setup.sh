#!/usr/bin/env bash
# On a GPU machine with a CUDA torch and no network: install the carried wheels (.whl, made by
# bench/device_prepare.py) into /tmp/site and the project into the interpreter that holds torch,
# compiling ext/ in place. Source it, so PYTHONPATH stays set:  . bench/device_setup.sh
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1 2>/dev/null || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "${OUT:-/tmp}/install.log" 2>&1 \
  || { tail -20 "${OUT:-/tmp}/install.log"; return 1 2>/dev/null || exit 1; }
python3 -c "import ext, torch; print('compiled ext:', sorted(m for m in ('bitmask', 'step_inputs', 'penalties', 'stop_strings', 'repetition', 'grammar_rows', 'grammar_step') if ext.is_compiled(m)), '| torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"
