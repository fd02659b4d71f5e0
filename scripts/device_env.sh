# Sourced by the scripts/gpu_*.sh device scripts, from the repository root: install the carried wheels
# (diffusers and the peers FA3 / SageAttention, which the GPU machine lacks; the folder WHEELS, default
# .whl, passed to the device tool as carry) into a fresh temporary site, and this project editable.
WHEELS=${WHEELS:-.whl}
if ! compgen -G "$WHEELS/*.whl" > /dev/null; then
  echo "$0: no wheels in $WHEELS/ (diffusers, fa3-fwd, sageattention, ...): put them there and carry the folder," \
       "or set WHEELS" >&2
  exit 2
fi
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null
export PYTHONPATH=$SITE
