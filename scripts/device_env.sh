# Sourced by scripts/gpu_check.sh and scripts/host_cpu_check.sh (with OUT set and the checkout as the working
# directory): the project importable from the checkout without installing it, and the wheels in .whl/.
#
# Nothing is installed into site-packages: the project's folders are linked under a temporary `specstep/`
# namespace (the import names an install maps them to) and the checkout is on PYTHONPATH for `tests.*`. Wheels
# in .whl/ (what the device machine's image lacks: msgspec, pyzmq, nvtx, gguf; FlashInfer where one fits) go
# into /tmp/site with `pip install --no-index --no-deps --target` and onto PYTHONPATH.
export OMP_WAIT_POLICY=PASSIVE
NS="$(mktemp -d)"
mkdir -p "$NS/specstep"
for d in engine scheduler cuda_graphs traces training loadgen; do ln -s "$PWD/$d" "$NS/specstep/$d"; done
export PYTHONPATH="$NS:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
export NS PY  # scripts/host_cpu_check.sh, run from scripts/gpu_check.sh, takes them as they are

if compgen -G ".whl/*.whl" > /dev/null; then
    if timeout 30 "$PY" -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1; then
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
        echo "installed $(ls .whl/*.whl | wc -l) wheel(s) from .whl/ into /tmp/site"
    else
        echo "WARNING: installing .whl/ wheels failed (see $OUT/pip.log); continuing without them"
    fi
else
    echo "no .whl/ directory with wheels: FlashInfer checks and the fi_* benchmarks are skipped, and a module the" \
         "image lacks (msgspec, pyzmq, nvtx, gguf) fails its imports"
fi
