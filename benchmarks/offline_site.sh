# Sourced by gpu_check.sh and cpu_isa_check.sh on a borrowed machine with no internet: the wheels that travelled in
# .gpu-wheels/ (pip download --no-deps -d .gpu-wheels NAME...) and radixserve itself, each into a folder of its
# own on PYTHONPATH, unless that machine already has them. Sets REPO (the checkout): pytest must run from outside
# it (cd /tmp), since run in it the root's radixserve/ stands in for the installed package (without kernels/,
# model/, ...) and every test module fails to import.
REPO=$PWD
if [ -d .gpu-wheels ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gpu-wheels .gpu-wheels/*.whl
  export PYTHONPATH=/tmp/gpu-wheels
fi
if ! (cd /tmp && $PY -c "import radixserve.actors, radixserve.kernels") 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/rs-site . &&
    export PYTHONPATH=/tmp/rs-site:${PYTHONPATH:-}
fi
