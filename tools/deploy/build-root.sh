#!/bin/sh
# build-root.sh — runs tools/deploy/Containerfile's steps in fresh Debian 12
# roots (debootstrap + chroot, for machines without podman or buildah),
# starts `duet serve` from the runtime root as the image's entrypoint would,
# and asks it for one completion. Not part of CI (minutes, root, network).
#
#     sudo sh tools/deploy/build-root.sh --model /path/to/model.gguf [options]
#
#   --model FILE   a GGUF model; its folder is bind-mounted read-only at
#                  /models in the runtime root (the pod's model volume)
#   --work DIR     where the roots go (default /var/tmp/duet-deploy)
#   --debs DIR     use the duet_*.deb already there instead of the build stage
#   --backend B    passed to duet serve (default auto: best device)
#   --port N       (default 8123)
#
# Stages, as in the Containerfile: `base` (debootstrap --variant=minbase
# bookworm, made once and copied), `build` (build tools, cmake, cpack -G
# DEB from a copy of the checkout's tracked files) and `run` (the .deb, the
# loaders and fallback drivers, the non-root user, the entrypoint). /proc,
# /sys and /dev are mounted in the roots as a container runtime would:
# without /sys, PoCL's hwloc finds no CPU and aborts when OpenCL devices are
# listed (bench/results/packaging-debian12.md).
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
src="$(cd "$here/../.." && pwd)"
work=/var/tmp/duet-deploy model="" debs="" backend=auto port=8123
while [ $# -gt 0 ]; do
    case "$1" in
    --model) model="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --debs) debs="$(cd "$2" && pwd)"; shift 2 ;;
    --backend) backend="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    *) echo "usage: $0 --model FILE [--work DIR] [--debs DIR] [--backend B] [--port N]" >&2; exit 2 ;;
    esac
done
[ -r "$model" ] || { echo "build-root.sh: --model FILE is required (a readable GGUF)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "build-root.sh: needs root (debootstrap, chroot, mount)" >&2; exit 2; }
model="$(cd "$(dirname "$model")" && pwd)/$(basename "$model")"
mkdir -p "$work"
log() { printf '\n=== %s: %s\n' "$(date -u +%H:%M:%S)" "$*"; }

mounted=""
mount_sys() { # the kernel file systems a container runtime gives a container
    for d in proc sys dev; do
        mountpoint -q "$1/$d" && continue
        case "$d" in
        proc) mount -t proc proc "$1/proc" ;;
        sys) mount -t sysfs sysfs "$1/sys" ;;
        dev) mount --rbind /dev "$1/dev" ;; # with /dev/pts
        esac
        mounted="$1/$d $mounted"
    done
}
cleanup() {
    [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null || true
    for m in $mounted; do umount -l "$m" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM
in_root() { # in_root ROOT COMMAND: sh -c in the root with a clean environment
    r="$1"; shift
    chroot "$r" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 /bin/sh -c "$*"
}
fresh_root() { # fresh_root NAME: a copy of the pristine base
    rm -rf "${work:?}/$1"
    cp -a "$work/base" "$work/$1"
    cp /etc/resolv.conf "$work/$1/etc/"
    # This network's proxies and certificates, when the host has them.
    [ -r /etc/pip.conf ] && cp /etc/pip.conf "$work/$1/etc/" || true
    for f in /etc/apt/apt.conf.d/*proxy* /etc/apt/apt.conf.d/99artifact-registry; do
        [ -r "$f" ] && cp "$f" "$work/$1/etc/apt/apt.conf.d/" || true
    done
    mount_sys "$work/$1"
}

if [ ! -x "$work/base/bin/sh" ]; then
    log "base: debootstrap --variant=minbase bookworm"
    rm -rf "$work/base.tmp"
    debootstrap --variant=minbase bookworm "$work/base.tmp" >"$work/debootstrap.log" 2>&1 ||
        { tail -20 "$work/debootstrap.log"; exit 1; }
    mv "$work/base.tmp" "$work/base"
fi
log "base: $(cat "$work/base/etc/debian_version"), $(du -sh "$work/base" | cut -f1)"

if [ -z "$debs" ]; then
    log "build stage: build tools, cmake, cpack -G DEB (the Containerfile's first FROM)"
    fresh_root build
    mkdir -p "$work/build/src"
    (cd "$src" && git ls-files -z | xargs -0 tar cf - ) | tar xf - -C "$work/build/src"
    in_root "$work/build" "apt-get update -qq && apt-get install -y -qq --no-install-recommends \
        build-essential cmake pkg-config git file dpkg-dev libpcre2-dev libcjson-dev libmicrohttpd-dev \
        libcurl4-openssl-dev python3 libvulkan-dev libvulkan-volk-dev glslc spirv-tools \
        ocl-icd-opencl-dev opencl-headers libclblast-dev >/dev/null"
    in_root "$work/build" "cmake -S /src -B /build -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr \
        -DDUET_TESTS=OFF >/dev/null && cmake --build /build -j\$(nproc) >/dev/null && cd /build && \
        cpack -G DEB >/dev/null && ls -l duet_*.deb"
    debs="$work/debs"
    rm -rf "$debs" && mkdir -p "$debs"
    cp "$work"/build/build/duet_*.deb "$debs/"
fi
ls "$debs"/duet_*.deb >/dev/null

log "run stage: duet's .deb, loaders, lavapipe, PoCL, user duet (the Containerfile's second FROM)"
fresh_root run
mkdir -p "$work/run/tmp/debs" "$work/run/models"
cp "$debs"/duet_*.deb "$work/run/tmp/debs/"
in_root "$work/run" "apt-get update -qq && apt-get install -y -qq --no-install-recommends \
    /tmp/debs/duet_*.deb libvulkan1 ocl-icd-libopencl1 mesa-vulkan-drivers pocl-opencl-icd \
    ca-certificates curl >/dev/null && rm -rf /var/lib/apt/lists/* /tmp/debs && \
    mkdir -p /etc/OpenCL/vendors /models && \
    { groupadd --system render 2>/dev/null || true; } && \
    useradd --uid 10001 --user-group --groups video,render --home-dir /home/duet --create-home \
        --shell /usr/sbin/nologin duet"
install -m 0755 "$here/entrypoint.sh" "$work/run/usr/local/bin/duet-entrypoint"
in_root "$work/run" "dpkg -l duet | tail -1; duet --version; du -sh --exclude=proc --exclude=sys --exclude=dev / 2>/dev/null | cut -f1"

log "devices the non-root user sees (duet devices)"
chroot --userspec=10001:10001 "$work/run" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/home/duet \
    /usr/local/bin/duet-entrypoint devices

log "the model volume: $(dirname "$model") read-only at /models"
mount --bind "$(dirname "$model")" "$work/run/models"
mounted="$work/run/models $mounted"
mount -o remount,bind,ro "$work/run/models"

log "start: duet-entrypoint serve --model /models/$(basename "$model") (uid 10001)"
chroot --userspec=10001:10001 "$work/run" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/home/duet \
    NVIDIA_DRIVER_CAPABILITIES=compute,graphics,utility \
    /usr/local/bin/duet-entrypoint serve --host 127.0.0.1 --port "$port" --model "/models/$(basename "$model")" \
    --backend "$backend" --drain-timeout 30 >"$work/serve.log" 2>&1 &
pid=$!
ready=""
for _ in $(seq 1 600); do
    code="$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/ready" || true)"
    [ "$code" = 200 ] && { ready=1; break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
done
cat "$work/serve.log"
[ -n "$ready" ] || { echo "build-root.sh: the server never became ready" >&2; exit 1; }
set -x
curl -s "http://127.0.0.1:$port/health"; echo
curl -s "http://127.0.0.1:$port/ready"; echo
curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}'
echo
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^vllm:(cache_config_info|num_requests_waiting|num_requests_running|kv_cache_usage_perc)'
kill -TERM "$pid"
wait "$pid" && rc=0 || rc=$?
pid=""
set +x
tail -3 "$work/serve.log"
echo "duet serve exited with $rc after SIGTERM"
[ "$rc" = 0 ]
